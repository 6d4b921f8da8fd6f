"""Evaluation: the lm-eval model ``hybrid`` (lm_eval_model), offline MMLU tasks (tasks/mmlu_local), MQAR
(mqar), the prefill timing core (timing) and the prefill-speed versus accuracy report (tradeoff). The
benchmark scripts live in the repo's top-level ``benchmarks/``, not in the installed package."""
