"""MambaInLlama's attention -> Mamba-2 / Gated DeltaNet mapping (hybrid.distill.init).

The exact check: with the SSM reduced to causal linear attention (no decay A = 0, dt = 1, no conv, no gate or
norm, D = 0), the mapped layer's x/B/C through our SSD kernel are linear attention of the teacher's un-rotated
q/k/v, GQA groups respected. Gated DeltaNet's delta rule is not linear attention for any write strength beta > 0;
it tends to it as beta -> 0 (o / beta), which is checked with a tolerance from that limit."""

from __future__ import annotations

import pytest
import torch
from distill_helpers import tiny_teacher
from hybrid.kernels.gated_delta import gated_delta_ref, l2norm_heads

from hybrid import kernels
from hybrid.distill.init import TeacherError, check_teacher, replacement_from_attention, student_config


def linear_attention(q, k, v):
    """out_t = sum_{s <= t} (q_t . k_s) v_s per query head, kv head h // (Hq / Hkv); fp64. q [B, L, Hq, D]."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2).double(), v.repeat_interleave(rep, 2).double()
    scores = torch.einsum("bthd,bshd->bhts", q.double(), k).tril()
    return torch.einsum("bhts,bshd->bthd", scores, v)


def test_mamba2_mapping_is_linear_attention_of_the_teacher():
    teacher = tiny_teacher()
    attn = teacher.layers[2].mixer
    m = replacement_from_attention(teacher.config, attn, "mamba2")
    u = torch.randn(2, 37, 32)
    q, k, v = attn.project(u)
    ref = attn.o_proj(linear_attention(q, k, v).float().reshape(2, 37, -1)).double()

    z, xBC, dt_raw = m.split_projection(m.in_proj(u))
    x, B, C = m.split_xBC(xBC)  # no conv
    dt, A = torch.ones(2, 37, m.n_heads), torch.zeros(m.n_heads)  # dt = 1, no decay
    for scan in (lambda: kernels.ssd_chunk_scan(x, dt, A, B, C, chunk_size=16)[0],
                 lambda: kernels.ssd.ssd_scan_ref(x, dt, A, B, C)[0]):
        y = m.out_proj(scan().reshape(2, 37, -1))  # D = 0, no gate or norm
        err = (y.double() - ref).abs().max() / ref.abs().max()
        assert err < 1e-5, err  # fp32 sums of 37 terms: ~1e-7 relative; a wrong row would be O(1)
    # and the parts left out start as documented: dt = 1 from the raw projection, the conv passes silu(xBC)
    # through, the gate is a constant (which the per-head gated norm ignores)
    dt_real, _ = m.dt_A(dt_raw)
    assert torch.allclose(dt_real, torch.ones_like(dt_real), atol=1e-6)
    conv_out, _ = kernels.causal_conv1d(xBC, m.conv1d.weight[:, 0], m.conv1d.bias, activation="silu")
    assert torch.allclose(conv_out, torch.nn.functional.silu(xBC), atol=1e-6)
    z = z.detach()
    assert torch.all(z == z[0, 0, 0]) and float(z[0, 0, 0]) > 3.0
    assert torch.all(m.D == 0)


def test_gdn_mapping_tends_to_linear_attention_as_beta_vanishes():
    teacher = tiny_teacher()
    attn = teacher.layers[4].mixer
    g_layer = replacement_from_attention(teacher.config, attn, "gdn")
    u = torch.randn(2, 21, 32)
    q, k, v = attn.project(u)
    qkv, z, b, a = g_layer.split_projection(g_layer.in_proj(u))
    qm, km, vm = g_layer.split_qkv(qkv)  # no conv; q, k L2-normalised per head as the layer does
    # shape by shape: the projected rows are the teacher's, k and v repeated per GQA group
    rep = attn.n_heads // attn.n_kv_heads
    assert torch.allclose(vm, v.repeat_interleave(rep, 2), atol=1e-6)
    assert torch.allclose(qm, l2norm_heads(q), atol=1e-6)
    assert torch.allclose(km, l2norm_heads(k.repeat_interleave(rep, 2)), atol=1e-6)
    beta_eps = 1e-6
    g0 = torch.zeros(2, 21, g_layer.n_heads)
    o, _ = gated_delta_ref(qm, km, vm, g0, torch.full_like(g0, beta_eps))
    ref = linear_attention(l2norm_heads(q) * attn.head_dim ** -0.5, l2norm_heads(k), v)
    # the delta rule's correction -beta k k^T S is O(beta * t) relative to the write beta k v^T: ~2e-5 here,
    # plus fp32 rounding of o / beta; a wrong mapping is off by O(1)
    err = ((o.double() / beta_eps) - ref).abs().max() / ref.abs().max()
    assert err < 1e-3, err
    # the gate starts as the identity: norm weight * silu(z) = 1
    assert torch.allclose(g_layer.norm.weight * torch.nn.functional.silu(z[0, 0, :8]), torch.ones(8), atol=1e-5)
    assert torch.equal(g_layer.out_proj.weight, attn.o_proj.weight)


def test_student_config_replaces_the_chosen_attention_layers():
    teacher = tiny_teacher(n_layers=4)
    cfg = student_config(teacher.config, {1, 3}, "mamba2")
    assert cfg.pattern == "M-*-M-*-"
    assert (cfg.mamba2.n_heads, cfg.mamba2.head_dim, cfg.mamba2.n_groups, cfg.mamba2.d_state) == (4, 8, 4, 8)
    assert student_config(teacher.config, set(), "gdn").pattern == "G-" * 4
    with pytest.raises(ValueError, match="do not exist"):
        student_config(teacher.config, {4}, "mamba2")
    with pytest.raises(TeacherError, match="Llama-family"):
        check_teacher(cfg)


@pytest.mark.parametrize("mixer", ["mamba2", "gdn"])
def test_head_scale_calibration_is_the_least_squares_fit(mixer):
    """calibrate_head_scales: per head the out_proj columns scaled by the least-squares factors, so the fit is
    no worse than the raw mapping (factors 1 are a candidate) and a second calibration finds factors 1."""
    from hybrid.distill.align import calibrate_head_scales, nmse

    teacher = tiny_teacher()
    attn = teacher.layers[2].mixer
    rep = replacement_from_attention(teacher.config, attn, mixer)
    u = torch.randn(3, 29, 32)
    with torch.no_grad():
        target = attn(u)
        before = float(nmse(rep(u), target))
        alpha = calibrate_head_scales(rep, u, target)
        after = float(nmse(rep(u), target))
        again = calibrate_head_scales(rep, u, target)
    assert after <= before and not torch.allclose(alpha, torch.ones_like(alpha))
    assert torch.allclose(again, torch.ones_like(again), atol=1e-3), again
