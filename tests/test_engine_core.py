"""The engine's structure: no host syncs inside the layers, on-device sampling with seeds that hold across
batch compositions, the compiled decode step equal to the eager one, and the step-time split."""

import pytest
import torch

from hybrid import Engine, HybridLM, SamplingParams, recipes
from hybrid.engine.runner import bucket_sizes

TINY = [n for n in recipes.names() if n.endswith("-tiny")]


def tiny_model(name: str, sharpen: float = 30.0) -> HybridLM:
    torch.manual_seed(0)
    model = HybridLM(recipes.get(name)).eval()
    with torch.no_grad():  # sharper logits than the 0.02 init: greedy picks far from ties, samples spread out
        (model.lm_head.weight if model.lm_head is not None else model.embed.weight).mul_(sharpen)
    return model


def prompts_of(lengths, vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


class SyncCounter:
    """Counts device->host reads (``tolist``, ``item``, ``int``/``float``/``bool`` of a tensor) made while
    any of the model's blocks is running."""

    NAMES = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")

    def __init__(self, model, monkeypatch):
        self.inside, self.calls = 0, []
        for name in self.NAMES:
            real = getattr(torch.Tensor, name)

            def counted(t, *a, _real=real, _name=name, **kw):
                if self.inside:
                    self.calls.append(_name)
                return _real(t, *a, **kw)

            monkeypatch.setattr(torch.Tensor, name, counted)
        for block in model.layers:
            block.register_forward_pre_hook(self._enter)
            block.register_forward_hook(self._leave)

    def _enter(self, *_):
        self.inside += 1

    def _leave(self, *_):
        self.inside -= 1


def _start(name, lengths):
    model = tiny_model(name)
    engine = Engine(model, num_blocks=64, block_size=4, max_seqs=4, max_batch_tokens=64)
    for p in prompts_of(lengths):
        engine.add_request(p, SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.9, seed=1))
    engine.step()  # the prefills
    return model, engine


@pytest.mark.parametrize("name", ["hybrid-1to7-tiny", "jamba-tiny", "samba-tiny", "nemotronh-tiny", "llama-tiny"])
def test_no_host_syncs_inside_the_layers_of_a_decode_step(name, monkeypatch):
    """A decode step reads nothing back from the device inside any layer: the runner validated the
    metadata once and attached its host copies."""
    model, engine = _start(name, [9, 5, 17])
    counter = SyncCounter(model, monkeypatch)
    engine.step()
    engine.step()
    assert counter.calls == [] and engine.stats.decode_steps == 2


@pytest.mark.parametrize("name", ["hybrid-1to7-tiny", "nemotronh-tiny", "llama-tiny"])
def test_no_host_syncs_inside_the_layers_of_a_mixed_step(name, monkeypatch):
    """Decodes and a prefill in one packed batch (attention, Mamba-2, MLP layers): no sync either. (Mamba-1's
    prefill scan still reads its decay range back once per block to pick fp32 or fp64: a numerical
    safety check of that algorithm, not metadata.)"""
    model, engine = _start(name, [9, 5, 17])
    counter = SyncCounter(model, monkeypatch)
    engine.add_request(prompts_of([11], seed=1)[0], SamplingParams(max_new_tokens=2))
    engine.step()
    assert counter.calls == [] and engine.stats.prefill_tokens == 9 + 5 + 17 + 3 + 11


def test_the_sync_counter_sees_a_sync_when_there_is_one(monkeypatch):
    """The counter is not blind: a layer that reads a value back is caught."""
    model = tiny_model("llama-tiny")
    counter = SyncCounter(model, monkeypatch)
    mlp = model.layers[1].mixer
    real = mlp.forward
    mlp.forward = lambda x: real(x) * (1 + 0 * x.abs().max().item())
    engine = Engine(model, num_blocks=16, block_size=4)
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
    engine.run()
    assert "item" in counter.calls


def run_engine(model, prompts, params, block_size=4, **kw):
    engine = Engine(model, num_blocks=kw.pop("num_blocks", 128), block_size=block_size, **kw)
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params, strict=True)]
    engine.run()
    return [engine.requests[i].output for i in ids], engine


def test_seeds_are_reproducible_across_batch_compositions():
    """A seeded sampled request gives the same tokens alone, beside other requests (in any order, with any
    settings), and after being preempted."""
    model = tiny_model("hybrid-1to7-tiny")
    target = SamplingParams(max_new_tokens=10, temperature=0.9, top_k=40, top_p=0.9, min_p=0.01, seed=5)
    prompt = prompts_of([7])[0]
    alone = run_engine(model, [prompt], [target])[0][0]
    others = prompts_of([3, 12, 5], seed=2)
    other_params = [SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=12, temperature=1.3, seed=9),
                    SamplingParams(max_new_tokens=8, temperature=0.7, repetition_penalty=1.3, seed=2)]
    first, _ = run_engine(model, [prompt, *others], [target, *other_params])
    last, _ = run_engine(model, [*others, prompt], [*other_params, target], max_batch_tokens=8)
    tight, engine = run_engine(model, [*others, prompt], [*other_params, target], num_blocks=9, max_seqs=4,
                               max_batch_tokens=16)
    assert engine.stats.preemptions > 0
    assert first[0] == last[-1] == tight[-1] == alone
    assert run_engine(model, [prompt], [SamplingParams(**{**target.__dict__, "seed": 6})])[0][0] != alone


def test_only_sampled_ids_leave_the_device(monkeypatch):
    """Sampling reads back one list of ids per step and never the [B, V] logits."""
    model = tiny_model("llama-tiny")
    engine = Engine(model, num_blocks=32, block_size=4)
    for p in prompts_of([4, 6]):
        engine.add_request(p, SamplingParams(max_new_tokens=3, temperature=1.0, seed=3))
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(tuple(t.shape)) or real(t))
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t: pytest.fail(f"a tensor of shape {tuple(t.shape)} was copied"))
    engine.run()
    assert reads and all(shape in ((2,), (1,)) for shape in reads)


def test_stats_split_the_step_time():
    model = tiny_model("hybrid-1to7-tiny")
    _, engine = run_engine(model, prompts_of([5, 8]), [SamplingParams(max_new_tokens=6)] * 2)
    s = engine.stats
    parts = s.schedule_seconds + s.forward_seconds + s.sample_seconds + s.output_seconds
    assert s.decode_steps == 5 and s.decode_tokens == 10 and s.prefill_tokens == 13
    assert 0 < parts <= s.decode_seconds + s.prefill_seconds + 1e-6
    assert min(s.schedule_seconds, s.forward_seconds, s.sample_seconds, s.output_seconds) > 0
    assert set(s.time_to_first_token) == {0, 1} and all(t > 0 for t in s.time_to_first_token.values())


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(16) == [1, 2, 4, 8, 16]
    assert bucket_sizes(24) == [1, 2, 4, 8, 16, 24]


@pytest.mark.parametrize("name", TINY)
def test_compiled_decode_graph_equals_eager(name):
    """Every tiny recipe: greedy tokens (and seeded samples) through the compiled decode step equal the eager
    engine's, with the batch padded to its bucket (3 requests -> bucket 4). For one recipe the requests also finish
    at different steps, so the batch shrinks through buckets 4, 2, 1 (each a graph of its own: the bucketing is
    the runner's, not a mixer's, so the other recipes run one bucket). Dynamo captures the real graph;
    ``aot_eager`` runs it without Inductor's code generation (a minute or more per graph on this CPU); the
    Inductor test below compiles one recipe for real."""
    model = tiny_model(name)
    prompts = prompts_of([6, 3, 9], seed=4)
    shrinking = name == "hybrid-1to7-tiny"
    lengths = (9, 4, 7) if shrinking else (5, 5, 5)
    params = [SamplingParams(max_new_tokens=lengths[0]), SamplingParams(max_new_tokens=lengths[1]),
              SamplingParams(max_new_tokens=lengths[2], temperature=1.0, seed=3)]
    eager, _ = run_engine(model, prompts, params, block_size=16, max_seqs=4)
    compiled, engine = run_engine(model, prompts, params, block_size=16, max_seqs=4, compile=True,
                                  compile_backend="aot_eager")
    assert compiled == eager
    assert sorted(engine.runner.compiled_shapes) == ([(1, 1), (2, 1), (4, 1)] if shrinking else [(4, 1)])
    assert engine.cache_manager.num_free_blocks == engine.cache.kv.num_blocks  # padded rows held nothing


@pytest.mark.parametrize("name", ["samba-tiny", "hybrid-1to7-tiny"])
def test_compiled_decode_across_growing_block_tables(name):
    """Block tables widen as sequences grow (the longer one from 6 to 9 blocks of 4: widths padded to 8, then
    16); with a sliding window the blocks behind it point at the null block. Still the eager tokens."""
    model = tiny_model(name)
    prompts = prompts_of([3, 20], seed=6)
    params = [SamplingParams(max_new_tokens=14)] * 2
    eager, _ = run_engine(model, prompts, params, max_seqs=2)
    compiled, engine = run_engine(model, prompts, params, max_seqs=2, compile=True, compile_backend="aot_eager")
    assert compiled == eager
    assert sorted(engine.runner.compiled_shapes) == [(2, 8), (2, 16)]


def test_compiled_decode_with_inductor_equals_eager():
    """The real thing: Inductor-compiled decode on a hybrid, one shape (compile time is reported apart)."""
    model = tiny_model("hybrid-1to7-tiny")
    prompts = prompts_of([9, 10], seed=5)  # 3 to 4 blocks of 4 while decoding: one block-table width, 4
    params = [SamplingParams(max_new_tokens=4)] * 2
    eager, _ = run_engine(model, prompts, params, max_seqs=2)
    compiled, engine = run_engine(model, prompts, params, max_seqs=2, compile=True)
    assert compiled == eager
    assert engine.runner.compiled_shapes == [(2, 4)] and engine.stats.compile_seconds > 0
    assert engine.stats.compiled_steps == engine.stats.decode_steps == 2  # the compiling step is not counted


@pytest.mark.parametrize("name", ["hybrid-1to7-tiny", "llama-tiny", "samba-tiny", "mamba1-tiny"])
def test_fork_continues_like_the_same_tokens_run_alone(name):
    """A fork shares the prompt's cache; greedy, both branches give what the same tokens give alone, and a
    sampled fork with its own seed gives what a request with that seed gives from the same point."""
    model = tiny_model(name)
    prompt = prompts_of([13], seed=7)[0]
    engine = Engine(model, num_blocks=32, block_size=4, max_seqs=3)
    src = engine.add_request(prompt, SamplingParams(max_new_tokens=8))
    engine.step()
    engine.step()  # two tokens out, decoding
    branch = engine.fork(src)
    sampled = engine.fork(src, SamplingParams(max_new_tokens=8, temperature=1.0, seed=4))
    before = engine.cache_manager.num_free_blocks
    engine.run()
    greedy_alone, _ = run_engine(model, [prompt], [SamplingParams(max_new_tokens=8)])
    assert engine.requests[src].output == engine.requests[branch].output == greedy_alone[0]
    head = engine.requests[src].output[:2]
    # the fork's draws continue from 2 tokens: a fresh request with the same seed and the same two tokens
    fresh = Engine(model, num_blocks=32, block_size=4)
    rid = fresh.add_request(prompt, SamplingParams(max_new_tokens=8, temperature=1.0, seed=4))
    fresh.requests[rid].output.extend(head)  # the same two tokens, as if sampled
    fresh.run()
    assert engine.requests[sampled].output == fresh.requests[rid].output
    if engine.cache.kv.enabled:  # 14 cached tokens = 3 full blocks shared + 1 partial block each; all came back
        assert before == 32 - 4 - 1 - 1 and engine.cache_manager.num_free_blocks == 32
    with pytest.raises(ValueError, match="cannot be forked now"):
        engine.fork(src)


def test_trusted_metadata_skips_validation_unless_debug_checks(monkeypatch):
    """Ops trust lengths that carry host values (validated once by the runner); HYBRID_DEBUG_CHECKS=1
    validates them again in every op."""
    from hybrid.kernels import packing

    bad = packing.with_host_values(torch.tensor([0, 3, 2], dtype=torch.int32), (0, 3, 2))
    packing.check_cu_seqlens(bad, 2, "op")  # trusted: not re-checked
    with pytest.raises(ValueError, match="rise strictly"):
        packing.check_cu_seqlens(torch.tensor([0, 3, 2], dtype=torch.int32), 2, "op")  # a plain tensor is
    monkeypatch.setattr(packing, "DEBUG_CHECKS", True)
    with pytest.raises(ValueError, match="rise strictly"):
        packing.check_cu_seqlens(bad, 2, "op")
    model = tiny_model("hybrid-1to7-tiny")  # the runner's own metadata passes the re-validation
    assert run_engine(model, prompts_of([5, 9]), [SamplingParams(max_new_tokens=3)] * 2)[0] == \
        [run_engine(model, [p], [SamplingParams(max_new_tokens=3)])[0][0] for p in prompts_of([5, 9])]
