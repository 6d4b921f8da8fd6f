"""A pretrained transformer distilled into its hybrid family (MambaInLlama's init, MOHAWK's alignment, KL).

``init`` maps attention weights onto Mamba-2 / Gated DeltaNet mixers, ``align`` trains every layer's replacement
in one pass over the teacher's hidden states, ``student`` assembles a student for a choice of attention layers,
``kl`` trains it on the teacher's logits, ``pipeline.distill_family`` runs them all; ``ddp`` and ``trainer`` are
the shared training machinery. The teacher-written data lives in ``data`` (its own module)."""
