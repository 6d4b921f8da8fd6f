"""Evaluation: the lm-eval model ``hybrid`` (lm_eval_model), offline MMLU tasks (tasks/mmlu_local),
the prefill benchmark (prefill_bench), MQAR (mqar) and the prefill-speed versus accuracy report (tradeoff)."""
