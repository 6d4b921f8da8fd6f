"""lm-eval (lm-evaluation-harness) model ``hybrid``: any HybridLM scored through its own forward.

Importing this module registers it: ``lm_eval.simple_evaluate(model="hybrid",
model_args="pretrained=DIR,dtype=bfloat16,batch_size=8", ...)`` (``hybrid eval`` does that), or
``recipe=NAME`` for a freshly initialised recipe. lm-eval (0.4.13) finds external models only by such
an import (it has no plugin entry points), so from a shell, as lm-eval documents external models, run
its CLI after the import: ``hybrid-lm-eval --model hybrid --model_args pretrained=DIR --tasks
mmlu_local`` (a console script of this package: this import, then ``lm_eval``'s own ``cli_evaluate``,
with this package's tasks on ``--include_path``), or ``python -c "import hybrid.eval.lm_eval_model;
from lm_eval.__main__ import cli_evaluate; cli_evaluate()" --model hybrid ...``. lm-eval's default
device is ``cuda:0``; on a machine without CUDA the model warns and runs on the CPU.
Log-likelihoods come from one causal forward per distinct input: requests are sorted by length
(longest first, so memory runs out at once if it will), batched with right padding (the model is
causal, so padding after a sequence cannot change its logits) and scored only at their own
continuation positions. Generation goes through ``hybrid.generate`` (the paged engine).

With ``prefix_caching=True`` log-likelihoods are scored through the engine instead (``Engine.score``)
with its prefix cache on: requests are sorted so that those sharing a context are neighbours, and the
shared part (MMLU's five examples, a question's context before each choice) is prefilled once. The
numbers equal the direct computation (to fp32 noise).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from ..engine.config import EngineConfig
from ..kernels.dispatch import use_backend
from ..model import HybridLM
from ..tokenizer import load_tokenizer

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# generation kwargs lm-eval tasks send that map onto hybrid.generate
_GEN_KEYS = {"until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k"}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to run on: lm-eval passes its default ``cuda:0`` even where there is no CUDA; there the
    model runs on the CPU, with a warning, instead of failing inside torch."""
    if device is None:
        return torch.device("cpu")
    d = torch.device(device)
    if d.type == "cuda" and not torch.cuda.is_available():
        log.warning("device %s asked for (lm-eval's default is cuda:0), but torch sees no CUDA device here; "
                    "running on the CPU (pass --device cpu to silence this)", device)
        return torch.device("cpu")
    return d


@register_model("hybrid")
class HybridEvalLM(TemplateLM):
    """lm-eval's view of a :class:`HybridLM`.

    Args:
        pretrained: a checkpoint folder (anything ``hybrid.from_pretrained`` loads) or a HybridLM.
        recipe: a recipe name (``hybrid info --list``) to evaluate freshly initialised weights.
        tokenizer: folder or tokenizer.json; defaults to the checkpoint folder, else byte-level.
        dtype, device: where the model runs. batch_size: distinct inputs per forward.
        max_length: longest input; longer contexts are cut on the left. max_gen_toks: generation
        budget when a task gives none. backend: force a kernel backend (torch/triton/cuda).
        prefix_caching: score through the engine with its prefix cache (``prefix_state_bytes``,
        ``prefix_checkpoint_interval``, ``cache_bytes`` and ``max_batch_tokens`` size it).
        quantize: torchao weight-only quantisation of the linear layers (``int8wo`` or ``int4wo``,
        :func:`hybrid.quantize`), to measure what it costs in accuracy. verify: check the checkpoint's
        checksums and finite weights on load (default true; ``hybrid.from_pretrained(verify=)``).
    """

    def __init__(self, pretrained: str | HybridLM | None = None, recipe: str | None = None,
                 tokenizer: str | None = None, dtype: str = "float32", device: str | None = "cpu",
                 batch_size: int | str = 8, max_length: int = 2048, max_gen_toks: int = 256,
                 backend: str | None = None, prefix_caching: bool | str = False,
                 prefix_state_bytes: int | None = None, prefix_checkpoint_interval: int | None = None,
                 cache_bytes: int = 1024 * 2**20, max_batch_tokens: int = 512, quantize: str | None = None,
                 verify: bool | str = True):
        super().__init__()
        if (pretrained is None) == (recipe is None):
            raise ValueError("give exactly one of pretrained=DIR (a checkpoint folder) or recipe=NAME")
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
        if str(batch_size).startswith("auto"):
            raise ValueError("batch_size=auto is not supported by the hybrid model; give a number, e.g. 8")
        self.batch_size = int(batch_size)
        self.max_length = int(max_length)
        self.max_gen_toks = int(max_gen_toks)
        if self.batch_size < 1 or self.max_length < 2 or self.max_gen_toks < 1:
            raise ValueError(f"need batch_size >= 1, max_length >= 2, max_gen_toks >= 1; got {self.batch_size}, "
                             f"{self.max_length}, {self.max_gen_toks}")
        self.backend = backend or None
        self.prefix_caching = str(prefix_caching).lower() in ("true", "1", "yes")
        if str(prefix_caching).lower() not in ("true", "1", "yes", "false", "0", "no"):
            raise ValueError(f"prefix_caching must be true or false, got {prefix_caching!r}")
        # lm-eval passes model_args as strings; the config is checked here, before any request runs
        self.engine_config = EngineConfig(
            cache_bytes=int(cache_bytes), max_batch_tokens=int(max_batch_tokens), max_seqs=self.batch_size,
            prefix_caching=True,
            prefix_state_bytes=None if prefix_state_bytes is None else int(prefix_state_bytes),
            prefix_checkpoint_interval=None if prefix_checkpoint_interval is None else int(prefix_checkpoint_interval))
        self.engine = None
        self.tokens_computed = 0  # model input positions run for log-likelihoods (both paths)
        self._device = resolve_device(device)
        if str(verify).lower() not in ("true", "1", "yes", "false", "0", "no"):
            raise ValueError(f"verify must be true or false, got {verify!r}")
        self.verify = str(verify).lower() in ("true", "1", "yes")
        self.model = self._build_model(pretrained, recipe, DTYPES[dtype])
        if quantize:
            from ..quantize import quantize as quantize_model

            quantize_model(self.model, quantize)  # ValueError naming the methods for an unknown one
        tok_source = tokenizer if tokenizer is not None else (pretrained if isinstance(pretrained, str) else None)
        self.tokenizer = load_tokenizer(tok_source)
        self.name = pretrained if isinstance(pretrained, str) else recipe or type(pretrained).__name__

    def _build_model(self, pretrained, recipe, dtype) -> HybridLM:
        from .. import from_pretrained, recipes

        if isinstance(pretrained, HybridLM):
            model = pretrained.to(device=self._device, dtype=dtype)
        elif pretrained is not None:
            model = from_pretrained(pretrained, dtype=dtype, device=self._device, verify=self.verify)
        else:
            with torch.device(self._device):
                model = HybridLM(recipes.get(recipe))
            model = model.to(dtype)
        return model.eval()

    # ---- tokens --------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def _valid_id(self, i) -> bool:
        return i is not None and 0 <= i < self.vocab_size

    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        if not self._valid_id(eos):
            raise ValueError(f"the tokenizer's end-of-text id {eos} does not fit the model's vocab_size "
                             f"{self.vocab_size}; empty contexts and rolling log-likelihoods need it, so "
                             f"use a model whose vocabulary includes the tokenizer's special tokens")
        return eos

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if self._valid_id(bos) else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # lm-eval's own contexts carry no special tokens (as its HF model does for causal LMs)
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def tok_decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    @property
    def tokenizer_name(self) -> str:
        return f"hybrid:{self.name}"

    def get_model_info(self) -> dict:
        cfg = self.model.config
        return {"model_num_parameters": self.model.num_parameters(), "model_pattern": cfg.pattern,
                "model_dtype": str(next(self.model.parameters()).dtype), "max_length": self.max_length}

    # ---- scoring -------------------------------------------------------------------------------
    @torch.inference_mode()
    def _forward_logprobs(self, rows: list[list[int]], scored: list[int]) -> list[torch.Tensor]:
        """Right-padded forward of ``rows``; per row the float32 log-probabilities [scored[i], V] of its last
        ``scored[i]`` positions. Only the positions some row scores go through the LM head and the softmax: a
        5-shot MMLU input is hundreds of tokens of which one is scored, and with a 32K-50K vocabulary the head
        over every position costs more than the layers."""
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        kept = sorted({p for r, k in zip(rows, scored, strict=True) for p in range(len(r) - k, len(r))})
        column = {p: j for j, p in enumerate(kept)}
        with use_backend(self.backend):
            logits = self.model(ids.to(self._device), logits_to_keep=torch.tensor(kept, device=self._device))
        return [F.log_softmax(logits[i, [column[p] for p in range(len(r) - k, len(r))]].float(), dim=-1)
                for i, (r, k) in enumerate(zip(rows, scored, strict=True))]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """Score ``(key, context_ids, continuation_ids)``: sum of log P(continuation | context) and
        whether greedy decoding would produce the continuation."""
        inputs: dict[tuple[int, ...], list[int]] = {}  # distinct model input -> request indices
        for n, (_, ctx, cont) in enumerate(requests):
            if not cont:
                raise ValueError("an empty continuation cannot be scored")
            if not ctx:  # its first token would have no position predicting it
                raise ValueError("an empty context cannot be scored: start it with the prefix token "
                                 "(lm-eval does, through prefix_token_id)")
            if len(cont) > self.max_length:
                raise ValueError(f"a continuation of {len(cont)} tokens does not fit max_length {self.max_length}")
            # the last token is only predicted, never fed; keep at most max_length inputs (left cut)
            inp = tuple((ctx + cont)[-(self.max_length + 1):][:-1])
            inputs.setdefault(inp, []).append(n)
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        if self.prefix_caching:
            return self._loglikelihood_engine(requests, inputs, results, disable_tqdm)
        order = sorted(inputs, key=len, reverse=True)
        self.tokens_computed += sum(len(i) for i in order)
        batches = [order[i: i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        for batch in tqdm(batches, desc="loglikelihood", unit="batch", disable=disable_tqdm):
            longest = [max(len(requests[n][2]) for n in inputs[inp]) for inp in batch]  # positions to score
            for inp, logprobs in zip(batch, self._forward_logprobs([list(b) for b in batch], longest), strict=True):
                for n in inputs[inp]:
                    key, _, cont = requests[n]
                    scored = logprobs[len(logprobs) - len(cont):]
                    target = torch.tensor(cont, device=scored.device)
                    total = float(scored.gather(1, target[:, None]).sum())
                    greedy = bool((scored.argmax(-1) == target).all())
                    results[n] = (total, greedy)
                    if key is not None:
                        self.cache_hook.add_partial("loglikelihood", key, results[n])
        return results

    def _loglikelihood_engine(self, requests, inputs, results, disable_tqdm):
        """Score through the engine's prefix cache: each distinct input once, in token order so that inputs
        sharing a prefix run one after another."""
        from ..engine import Engine

        if self.engine is None:
            self.engine = Engine(self.model, self.engine_config)
        order = sorted(inputs)  # token order: inputs sharing a prefix are neighbours
        # each input once; the rows score every continuation token but the last, which next_logprobs gives
        jobs = [(list(inp), len(inp) - min(len(requests[n][2]) for n in inputs[inp]) + 1) for inp in order]
        before = self.engine.stats.prompt_tokens_computed
        with use_backend(self.backend):
            scores = self.engine.score(jobs, progress=not disable_tqdm)
        self.tokens_computed += self.engine.stats.prompt_tokens_computed - before
        for inp, score in zip(order, scores, strict=True):
            for n in inputs[inp]:
                key, _, cont = requests[n]
                k = len(score.logprobs) - (len(cont) - 1)
                last = score.next_logprobs
                total = float(sum(score.logprobs[k:])) + float(last[cont[-1]])
                greedy = all(score.greedy[k:]) and int(last.argmax()) == cont[-1]
                results[n] = (total, bool(greedy))
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, results[n])
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-text log-likelihood in disjoint windows of ``max_length`` predictions, each window
        conditioned on as much preceding text as fits."""
        windows, owner = [], []
        for n, (string,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(string)
            for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                    context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(n)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owner, scores, strict=True):
            totals[n] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---- generation ----------------------------------------------------------------------------
    def _generation_settings(self, gen_kwargs: dict) -> dict:
        unknown = sorted(set(gen_kwargs) - _GEN_KEYS)
        if unknown:
            log.warning("hybrid model ignores generation kwargs %s (it understands %s)", unknown, sorted(_GEN_KEYS))
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        sampling = bool(gen_kwargs.get("do_sample", False))
        return {"until": until, "max_new_tokens": int(gen_kwargs.get("max_gen_toks", self.max_gen_toks)),
                "temperature": float(gen_kwargs.get("temperature", 0.0)) if sampling else 0.0,
                "top_p": float(gen_kwargs.get("top_p", 1.0)) if sampling else 1.0,
                "top_k": int(gen_kwargs.get("top_k", 0)) if sampling else 0}

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continue each context until a stop string, the end-of-text token or ``max_gen_toks``;
        the returned text ends before the first stop string."""
        from .. import generate

        groups: dict[str, list[int]] = {}  # requests with the same settings run as one engine batch
        settings = []
        for n, req in enumerate(requests):
            settings.append(self._generation_settings(dict(req.args[1])))
            groups.setdefault(repr(settings[-1]), []).append(n)
        outputs: list[str | None] = [None] * len(requests)
        eos = self.tokenizer.eos_token_id
        for members in tqdm(groups.values(), desc="generate_until", unit="group", disable=disable_tqdm):
            s = settings[members[0]]
            budget = self.max_length - s["max_new_tokens"]
            if budget < 1:
                raise ValueError(f"max_gen_toks {s['max_new_tokens']} leaves no room for context in "
                                 f"max_length {self.max_length}")
            prompts = []
            for n in members:
                ids = self.tok_encode(requests[n].args[0]) or [self.prefix_token_id]
                prompts.append(ids[-budget:])
            with use_backend(self.backend):
                generated = generate(self.model, prompts, max_new_tokens=s["max_new_tokens"],
                                     temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"],
                                     stop=s["until"], stop_token_ids=[eos] if self._valid_id(eos) else None,
                                     tokenizer=self.tokenizer)
            for n, ids in zip(members, generated, strict=True):
                text = self.tok_decode(ids)
                for stop in s["until"]:
                    if stop:
                        text = text.split(stop, 1)[0]
                outputs[n] = text
                self.cache_hook.add_partial("generate_until", requests[n].args, text)
        return outputs
