"""Evaluation: prefill benchmark (and, as they land, the lm-eval model and the tradeoff report)."""
