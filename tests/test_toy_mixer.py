"""A mixer kind added from this file alone (docs/adding-a-mixer.md's worked example): its cache spec, its layer
(full forward, packed forward, reference step), its decode lowering built from the program's existing ops, and its
registration. Nothing outside this file knows it, and the engine runs it on the native decode program: greedy
tokens equal to the full forward's and to the eager layers'.

The toy is a short-conv mixer (H3's shift SSM, Hyena's short filter): ``out(silu(conv_K(in(x))))``, a causal
depthwise conv over a projection, its constant-size state the last ``K - 1`` inputs per sequence. The program
expresses it with ops it already has: RMSNORM (the pre-norm), GEMV, CONV (the conv step with SiLU, its state row
shifted in place), GEMV with the residual."""

from __future__ import annotations

import pytest
import torch
from decode_hooks import eager_step_logits, no_native_steps, sublayer_ops, whole_step_logits
from hybrid.kernels import native, use_backend
from test_native_decode import _noise
from torch import nn

from hybrid import Engine, HybridLM, kernels, recipes
from hybrid.cache.specs import StateSpec, StateTensorSpec
from hybrid.layers.linear import Linear
from hybrid.layers.registry import register_layer
from hybrid.sampling import SamplingParams

pytestmark = pytest.mark.skipif(native.available() is not None, reason=f"native kernels: {native.available()}")

SYMBOL = "~"


class ToyConv(nn.Module):
    kind = "toy_conv"
    width, taps = 96, 4  # conv channels, conv taps (fixed: the kind has no config section)

    # ---- the spec: how it is built, what it caches, what it costs ----------------------------------
    @classmethod
    def from_config(cls, cfg) -> ToyConv:
        return cls(cfg.d_model)

    @staticmethod
    def cache_spec(cfg, dtypes) -> StateSpec:
        return StateSpec((StateTensorSpec("conv", (ToyConv.width, ToyConv.taps - 1), dtypes.conv),))

    @staticmethod
    def flops_per_token(cfg, seq_len: int) -> float:
        return 2.0 * ToyConv.taps * ToyConv.width

    # ---- the layer ---------------------------------------------------------------------------------
    def __init__(self, d_model: int):
        super().__init__()
        self.in_proj = Linear(d_model, self.width, bias=False)
        self.conv1d = nn.Conv1d(self.width, self.width, self.taps, groups=self.width, bias=True)
        self.out_proj = Linear(self.width, d_model, bias=False)

    def reset_special_parameters(self, std: float | None = None) -> None:
        self.conv1d.reset_parameters()

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        y, _ = kernels.causal_conv1d(self.in_proj(u), self.conv1d.weight[:, 0], self.conv1d.bias, activation="silu")
        return self.out_proj(y)

    def step(self, state, x: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """The reference step: one token per sequence, x [n, width], the conv state of rows ``slots`` shifted."""
        return state["conv"].step(kernels.causal_conv1d_step, x, self.conv1d.weight[:, 0], self.conv1d.bias,
                                  activation="silu", slots=slots)

    def forward_packed(self, u: torch.Tensor, batch, cache) -> torch.Tensor:
        x, ys = self.in_proj(u), []
        if (d := batch.decode) is not None:
            ys.append(self.step(cache, x[d.tokens], slots=d.state_slots))
        if (vr := batch.verify) is not None:  # speculative verify chunks: the state kept at every position
            ys.append(batch.verify_states.run(cache, (x[vr.tokens],), self.step))
        if (p := batch.scan) is not None:
            pool = cache["conv"]
            y, final = kernels.causal_conv1d_varlen(x[p.tokens], self.conv1d.weight[:, 0], self.conv1d.bias,
                                                    p.cu_seqlens, initial_states=pool.read(p.state_slots),
                                                    activation="silu")
            pool.write(p.state_slots, final)
            ys.append(y)
        return self.out_proj(torch.cat(ys) if len(ys) > 1 else ys[0])

    # ---- the lowering: the decode sub-layer as the program's ops -------------------------------------
    def lower_decode(self, b, norm, view) -> None:
        (pool,) = b.float_pools(view, ("conv",))
        d_model = self.in_proj.in_features
        h, x, y = b.buffer(d_model), b.buffer(self.width), b.buffer(self.width)
        b.norm(norm, b.X, h)
        b.linear(self.in_proj, h, x)
        b.causal_conv(self.conv1d, pool, x, self.width, y)
        b.linear(self.out_proj, y, b.X, residual=b.X)


class ToyConvUnlowered(ToyConv):
    """The same layer without a lowering: the native program must say which layer and why."""
    kind = "toy_conv_unlowered"
    lower_decode = None


@pytest.fixture
def toy():
    undo = [register_layer(ToyConv, symbol=SYMBOL), register_layer(ToyConvUnlowered, symbol="^")]
    yield
    for u in undo:
        u()


def _model(pattern: str, dtype=torch.float32) -> HybridLM:
    import dataclasses

    torch.manual_seed(0)
    model = HybridLM(dataclasses.replace(recipes.get("llama-tiny"), pattern=pattern)).to(dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # sharp logits: greedy ties do not decide the test
    return model


def _greedy(model, prompts, new_tokens, backend=None):
    with torch.inference_mode(), use_backend(backend):
        engine = Engine(model, num_blocks=64, block_size=16, max_seqs=4)
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)) for p in prompts]
        engine.run()
        return [engine.requests[i].output for i in ids], engine


def _forward_greedy(model, prompt, new_tokens):
    seq = list(prompt)
    with torch.inference_mode():
        for _ in range(new_tokens):
            seq.append(int(model(torch.tensor([seq]), logits_to_keep=1)[0, -1].argmax()))
    return seq[len(prompt):]


PROMPTS = [list(range(1, 12)), list(range(5, 30)), [3] * 7]


def test_toy_mixer_runs_on_the_native_program(toy):
    """The engine's decode steps run the whole-step native program, the toy among its layers; greedy tokens are the
    eager layers' (HYBRID_BACKEND=torch) and the full forward's."""
    model = _model(f"*{SYMBOL}-{SYMBOL}-*")
    assert model.layers[1].kind == "toy_conv" and model.layers[1].caches
    tokens, engine = _greedy(model, PROMPTS, 10)
    with torch.inference_mode():  # (what Engine.step runs under)
        assert engine.runner.decode_backend(1).name == "native_program", engine.runner.decode_report(1)
        assert engine.runner.decode_backend(3).name == "native_program"
    assert "native_program: chosen" in repr(engine)
    assert tokens == _greedy(model, PROMPTS, 10, backend="torch")[0]
    for p, got in zip(PROMPTS, tokens, strict=True):
        assert got == _forward_greedy(model, p, 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_toy_mixer_every_decode_step_is_the_whole_program(toy, monkeypatch, dtype):
    """Each decode step's logits come from the whole-step program, and are the eager layers' (fp32 noise; in bf16
    the final norm's other summation order, at most a rounding of the largest logit: test_native_decode's bound)."""
    model = _model(f"{SYMBOL}-*-{SYMBOL}-", dtype)
    got = whole_step_logits(monkeypatch)  # fails the test if a decode step does not run the program
    _greedy(model, PROMPTS, 6)
    monkeypatch.undo()
    eager = eager_step_logits(monkeypatch)
    _greedy(model, PROMPTS, 6)
    assert len(got) == len(eager) == 5
    for a, b in zip(got, eager, strict=True):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape == (len(PROMPTS), model.config.vocab_size)
        assert (a.float() - b.float()).abs().max() <= 1e-5 + 2 * _noise(b, dtype)


def test_toy_sublayer_is_the_eager_layers_bits_in_bf16(toy, monkeypatch):
    """Every decode step of each toy block: its lowered ops give the eager layer's output bits and leave the same
    conv state (restored between the two: a step shifts it)."""
    import hybrid.model as model_mod

    model = _model(f"*{SYMBOL}-{SYMBOL}-", torch.bfloat16)
    checked, plain = [], model_mod.Block.forward

    def both(self, x, batch=None, cache=None):
        if batch is None or batch.prefill is not None or self.kind != "toy_conv":
            return plain(self, x, batch, cache)
        view = cache.view(self.index)
        before = view["conv"].data.clone()
        fused = sublayer_ops(model, self, x, batch, cache)
        after = view["conv"].data.clone()
        view["conv"].data.copy_(before)
        eager = x + self.mixer.forward_packed(self.norm(x), batch, view)
        assert fused is not None and torch.equal(fused, eager)
        assert torch.equal(view["conv"].data, after)
        checked.append(self.index)
        return eager

    monkeypatch.setattr(model_mod.Block, "forward", both)
    no_native_steps(monkeypatch)  # the eager blocks, each beside its own native ops
    _greedy(model, PROMPTS, 5)
    assert sorted(set(checked)) == [1, 3] and len(checked) == 2 * 4


def test_a_kind_without_a_lowering_is_named_by_supports(toy):
    model = _model(f"*^-{SYMBOL}-")
    tokens, engine = _greedy(model, PROMPTS, 8)
    report = engine.runner.decode_report(1)
    with torch.inference_mode():  # (what Engine.step runs under)
        why = {b.name: b.supports(model, engine.cache, engine.runner.decode_shape(1))
               for b in engine.runner.decode_backends}
        assert engine.runner.decode_backend(1).name == "native_sublayers", report
    assert "layer 1 (toy_conv_unlowered)" in why["native_program"] and "lower_decode" in why["native_program"], why
    assert why["native_sublayers"] is None and why["eager"] is None, why
    assert tokens == _greedy(model, PROMPTS, 8, backend="torch")[0]
    assert tokens[0] == _forward_greedy(model, PROMPTS[0], 8)


def test_registering_a_taken_kind_or_symbol_is_refused(toy):
    with pytest.raises(ValueError, match="taken"):
        register_layer(ToyConv, symbol="@")
    Other = type("Other", (ToyConv,), {"kind": "toy_other"})
    with pytest.raises(ValueError, match="pattern symbol '~' is taken"):
        register_layer(Other, symbol=SYMBOL)
