"""interop_bench's parts: both sides take turns run by run (the timing helper it shares with
compression_bench), and a transformers model that cannot keep only the last logits is refused with what to do
instead."""

import pytest
import torch

from benchmarks import interop as interop_bench
from benchmarks.common import interleaved_seconds


def test_sides_take_turns_and_each_gets_every_repeat():
    calls = []
    times = interleaved_seconds({"ours": lambda: calls.append("o"), "hf": lambda: calls.append("h")},
                                              warmup=1, repeats=3)
    assert calls == ["o", "h"] * 4 and [len(v) for v in times.values()] == [3, 3]


def test_a_forward_without_logits_to_keep_is_refused():
    class Old(torch.nn.Module):
        def forward(self, input_ids, use_cache=False):
            return input_ids

    with pytest.raises(LookupError, match="takes no logits_to_keep.*--logits all"):
        interop_bench._check_takes_logits_to_keep("mamba2", Old())


@pytest.mark.parametrize("name", ["MambaForCausalLM", "Mamba2ForCausalLM", "BambaForCausalLM",
                                  "NemotronHForCausalLM", "JambaForCausalLM", "LlamaForCausalLM",
                                  "Qwen3NextForCausalLM"])
def test_the_compared_transformers_models_keep_last_logits(name):
    import inspect

    import transformers

    assert "logits_to_keep" in inspect.signature(getattr(transformers, name).forward).parameters
    with pytest.raises(ValueError, match="logits must be one of"):
        interop_bench.bench([], [8], 0, 1, logits="first")


def test_every_entry_exports_in_its_format():
    """Each benchmarked recipe, adjusted, is one its exporter takes (a refusal would only show as a skip)."""
    from hybrid.recipes import get as get_recipe

    from hybrid.interop import FORMATS, export_formats, export_problem

    assert {fmt for _, fmt, _ in interop_bench.ENTRIES.values()} <= set(export_formats())
    for name, (recipe, fmt, adjust) in interop_bench.ENTRIES.items():
        cfg = get_recipe(recipe)
        cfg = adjust(cfg) if adjust else cfg
        assert export_problem(FORMATS[fmt], cfg) is None, name
