"""Multi-step decode (``Engine(multi_step=k)``: up to k greedy decode steps in one native call) gives the tokens of one
step at a time, for every layer kind the native program covers, across block boundaries, with requests of different
lengths and stops in the middle of a call; it runs only where it may, and its statistics count every step."""

from __future__ import annotations

import pytest
import torch
from hybrid.kernels import native

from hybrid import Engine, HybridLM, recipes
from hybrid.sampling import SamplingParams

pytestmark = pytest.mark.skipif(native.available() is not None, reason=f"native kernels: {native.available()}")


def _model(recipe: str, dtype=torch.float32) -> HybridLM:
    torch.manual_seed(0)
    model = HybridLM(recipes.get(recipe)).to(dtype).eval()
    with torch.no_grad():  # logits far apart: an arithmetic difference would change a token
        (model.lm_head.weight if model.lm_head is not None else model.embed.weight).mul_(20)
    return model


def _run(model, prompts, params, *, multi_step: int, block_size: int = 4, **kw):
    engine = Engine(model, num_blocks=128, block_size=block_size, max_seqs=4, multi_step=multi_step, **kw)
    rids = [engine.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
    streamed = {r: [] for r in rids}
    calls = 0
    while engine.has_unfinished():
        calls += 1
        for out in engine.step():
            streamed[out.request_id] += out.new_token_ids
    outs = [engine.requests[r].output for r in rids]
    assert [streamed[r] for r in rids] == outs  # the streamed tokens are the outputs, in order
    return outs, [engine.requests[r].finish_reason for r in rids], calls, engine


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", ["llama-tiny", "mamba2-tiny", "hybrid-1to7-tiny", "gdn-tiny"])
def test_multi_step_equals_one_step_at_a_time(recipe, dtype):
    model = _model(recipe, dtype)
    prompts = [list(range(1, 8)), [5, 9, 2], list(range(3, 17))]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (13, 6, 9)]
    one, reasons1, calls1, _ = _run(model, prompts, params, multi_step=1)
    four, reasons4, calls4, engine = _run(model, prompts, params, multi_step=4)
    assert four == one and reasons4 == reasons1 == ["length"] * 3
    assert [len(o) for o in four] == [13, 6, 9]
    assert calls4 < calls1  # the calls did run several steps
    s = engine.stats
    assert s.decode_tokens == sum(len(o) - 1 for o in four)  # every token after each prefill's first
    assert s.decode_steps >= max(len(o) for o in four) - 1


@pytest.mark.parametrize("recipe", ["llama-tiny", "hybrid-1to7-tiny"])
def test_greedy_steps_in_c_equal_logits_sampled_in_python(recipe, monkeypatch):
    """A greedy decode step takes its argmax in C (hl_program_steps, one step a call or several); the tokens are
    those of the logits handed back and sampled by the engine's sampler."""
    from hybrid.engine.runner import ModelRunner

    model = _model(recipe, torch.bfloat16)
    prompts = [list(range(1, 8)), [5, 9, 2]]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (9, 6)]
    calls, real = [0], ModelRunner.run_steps

    def counted(self, chunks, steps):
        calls[0] += 1
        return real(self, chunks, steps)

    monkeypatch.setattr(ModelRunner, "run_steps", counted)
    in_c, _, _, _ = _run(model, prompts, params, multi_step=1)
    assert calls[0] >= 5  # every decode step after the prompts'
    monkeypatch.setattr(ModelRunner, "can_run_steps", lambda self: False)
    sampled, _, _, _ = _run(model, prompts, params, multi_step=1)
    assert in_c == sampled


def test_a_stop_inside_a_call_ends_the_request_there():
    model = _model("llama-tiny")
    prompt = list(range(1, 8))
    free, _, _, _ = _run(model, [prompt], [SamplingParams(max_new_tokens=12, ignore_eos=True)], multi_step=1)
    stop = free[0][5]  # a token the greedy run reaches mid-way (the first time it appears)
    cut = free[0].index(stop)
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=(stop,)),
              SamplingParams(max_new_tokens=12, ignore_eos=True)]
    got, reasons, _, engine = _run(model, [prompt, list(range(2, 9))], params, multi_step=4)
    one, _, _, _ = _run(model, [prompt, list(range(2, 9))], params, multi_step=1)
    assert got == one and got[0] == free[0][:cut] and reasons == ["stop", "length"]
    assert engine.cache_manager.num_free_slots == engine.cache.ssm.num_slots  # everything given back


def test_stop_strings_and_text_through_generate():
    """hybrid.generate (multi-step 8 by default) with a tokenizer: the texts, and a stop string that cuts a request
    inside a call, are those of one step at a time."""
    import hybrid

    model = _model("llama-tiny")
    tok = hybrid.load_tokenizer(None)  # bytes
    free = hybrid.generate(model, ["Hello"], max_new_tokens=24, tokenizer=tok, ignore_eos=True, multi_step=1)[0]
    i = next(i for i in range(5, len(free) - 2) if free.find(free[i:i + 2]) == i)  # first seen mid-way
    stop = [free[i:i + 2]]
    one = hybrid.generate(model, ["Hello", "Hi"], max_new_tokens=24, tokenizer=tok, ignore_eos=True, stop=stop,
                          multi_step=1)
    assert len(one[0]) < len(free)  # the stop did cut the first request
    assert hybrid.generate(model, ["Hello", "Hi"], max_new_tokens=24, tokenizer=tok, ignore_eos=True, stop=stop) == one
    assert hybrid.generate(model, ["Hello"], max_new_tokens=24, tokenizer=tok, ignore_eos=True) == [free]


def test_multi_step_runs_only_where_it_may():
    model = _model("hybrid-1to7-tiny")
    prompts = [list(range(1, 8)), [4, 4, 4]]
    sampled = [SamplingParams(max_new_tokens=8, temperature=0.8, seed=1), SamplingParams(max_new_tokens=8)]
    # a sampled request in the batch: one step per call, the same tokens as without multi_step
    a, _, calls_a, _ = _run(model, prompts, sampled, multi_step=4)
    b, _, calls_b, _ = _run(model, prompts, sampled, multi_step=1)
    assert a == b and calls_a == calls_b
    # a prefix cache: one step per call
    greedy = [SamplingParams(max_new_tokens=8)] * 2
    c, _, calls_c, _ = _run(model, prompts, greedy, multi_step=4, prefix_caching=True)
    d, _, calls_d, _ = _run(model, prompts, greedy, multi_step=1, prefix_caching=True)
    assert c == d and calls_c == calls_d


def test_multi_step_must_be_positive_and_is_shown():
    with pytest.raises(ValueError, match="multi_step"):
        Engine(HybridLM(recipes.get("llama-tiny")), multi_step=0)
    assert "greedy steps per native call: up to 4" in repr(Engine(HybridLM(recipes.get("llama-tiny")), multi_step=4))


def test_a_model_the_program_does_not_cover_steps_one_at_a_time_without_growing_ahead():
    model = _model("jamba-moe-tiny")  # MoE: the native program does not run its whole step
    prompts, params = [list(range(1, 8)), [4, 4, 4]], [SamplingParams(max_new_tokens=9)] * 2

    def free_blocks_per_step(multi_step):
        engine = Engine(model, num_blocks=128, block_size=4, max_seqs=4, multi_step=multi_step)
        rids = [engine.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
        free = []
        while engine.has_unfinished():
            engine.step()
            free.append(engine.cache_manager.num_free_blocks)
        return [engine.requests[r].output for r in rids], free, engine

    one, free1, _ = free_blocks_per_step(1)
    four, free4, engine = free_blocks_per_step(4)
    assert not engine.runner.can_run_steps()
    assert four == one and free4 == free1  # the same tokens, and no step held a block before its tokens needed it
