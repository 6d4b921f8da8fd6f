"""Batch generation: prompts in, their continuations out, through the :class:`Engine` (``hybrid.generate``)."""

from __future__ import annotations

from tqdm import tqdm

from .engine import Engine
from .engine.config import EngineConfig
from .sampling import SamplingParams

# The cache generate() builds holds every prompt at full length at once when that fits here;
# beyond it the engine queues and preempts.
MAX_AUTO_CACHE_BYTES = 2 * 2**30


# What sampling is when neither the caller nor the checkpoint's generation_config.json says: greedy, no filters.
SAMPLING_FALLBACKS = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}


def sampling_values(tokenizer, **given) -> dict:
    """SamplingParams keywords: each value in ``given`` that is not None, else the checkpoint's default
    (``tokenizer.sampling_defaults``, from its generation_config.json), else :data:`SAMPLING_FALLBACKS`."""
    defaults = getattr(tokenizer, "sampling_defaults", None) or {}
    out = {k: v for k, v in SAMPLING_FALLBACKS.items() if k in given}
    out.update({k: v for k, v in defaults.items() if k in given})
    out.update({k: v for k, v in given.items() if v is not None})
    return out


def generate(model, prompts: list[list[int]] | list[str], *, max_new_tokens: int, temperature: float | None = None,
             top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
             repetition_penalty: float | None = None, stop: list[str] | None = None,
             stop_token_ids: list[int] | None = None, tokenizer=None, seed: int | None = None,
             ignore_eos: bool = False, max_seqs: int = 32, max_batch_tokens: int = 2048, block_size: int = 16,
             progress: bool = False, multi_step: int = 8) -> list[list[int]] | list[str]:
    """Continue each prompt. Token-id prompts give lists of generated ids; string prompts (which
    need a tokenizer) give generated strings, cut before any ``stop`` string. ``tokenizer`` defaults to the
    model's own (``model.tokenizer``, which :func:`hybrid.from_pretrained` attaches).

    Generation stops at ``max_new_tokens``, a ``stop_token_ids`` id or the tokenizer's end-of-turn ids
    (``eos_token_ids``: generation_config.json's ``eos_token_id`` list and the tokenizer's EOS; unless
    ``ignore_eos``; stop ids are not part of the output) or a ``stop`` string. Every request uses
    ``seed``, so a prompt gives the same output whatever it is batched with. Sampling values left None take
    the checkpoint's generation_config.json defaults, else greedy with no filters (``temperature=0``); see
    :class:`SamplingParams` for the filters. ``multi_step``: greedy decoding on a CPU runs up to that
    many steps in one native call (:class:`Engine`'s ``multi_step``; the same tokens).
    """
    if tokenizer is None:
        tokenizer = getattr(model, "tokenizer", None)
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists or of strings")
    as_text = all(isinstance(p, str) for p in prompts)
    if as_text:
        if tokenizer is None:
            raise ValueError("string prompts need a tokenizer: pass tokenizer=load_tokenizer(...)")
        prompt_ids = [tokenizer.encode(p) for p in prompts]
    elif any(isinstance(p, str) for p in prompts):
        raise ValueError("prompts must be all strings or all token-id lists, not a mix")
    else:
        prompt_ids = [list(p) for p in prompts]
    sampling = sampling_values(tokenizer, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                               repetition_penalty=repetition_penalty)
    params = SamplingParams(max_new_tokens=max_new_tokens, seed=seed, stop_token_ids=tuple(stop_token_ids or ()),
                            stop=tuple(stop or ()), ignore_eos=ignore_eos, **sampling)
    engine = _engine_for(model, prompt_ids, max_new_tokens, tokenizer, max_seqs, max_batch_tokens, block_size,
                         multi_step)
    ids = [engine.add_request(p, params) for p in prompt_ids]
    with tqdm(total=len(ids), desc="generate", unit="seq", disable=not progress) as bar:
        while engine.has_unfinished():
            bar.update(sum(o.finished for o in engine.step()))
    reqs = [engine.requests[i] for i in ids]
    return [r.text for r in reqs] if as_text else [list(r.output) for r in reqs]


def _engine_for(model, prompt_ids, max_new_tokens, tokenizer, max_seqs, max_batch_tokens, block_size,
                multi_step) -> Engine:
    """An engine whose cache holds the ``max_seqs`` longest requests at once, if that fits in
    MAX_AUTO_CACHE_BYTES, else as many blocks as fit there (the engine then preempts)."""
    from .cache import HybridCache

    max_seqs = max(1, min(max_seqs, len(prompt_ids)))
    per_request = sorted((-(-(len(p) + max_new_tokens) // block_size) for p in prompt_ids), reverse=True)
    probe = HybridCache(model.config, num_blocks=0, max_seqs=max_seqs, block_size=block_size,
                        kv_dtype=next(model.parameters()).dtype, device="meta")
    affordable = (MAX_AUTO_CACHE_BYTES - probe.ssm.bytes_total) // max(probe.kv.bytes_per_block, 1)
    num_blocks = max(per_request[0], min(sum(per_request[:max_seqs]), affordable))
    return Engine(model, EngineConfig(num_blocks=num_blocks, block_size=block_size, max_seqs=max_seqs,
                                      max_batch_tokens=max_batch_tokens, multi_step=multi_step), tokenizer=tokenizer)
