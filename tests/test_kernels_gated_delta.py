"""The gated delta rule: chunked (WY/UT) = step by step = the token-by-token reference, packed = alone, bf16
within bf16 noise of the fp32 reference; and the reference itself against transformers' Qwen3-Next torch path."""

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err
from decode_hooks import avx2_build
from hybrid.kernels.gated_delta import l2norm

from hybrid import kernels


def _inputs(b, L, Hk, H, K, V, init=True, dtype=torch.float32):
    q, k = l2norm(torch.randn(b, L, Hk, K)), l2norm(torch.randn(b, L, Hk, K))
    v = torch.randn(b, L, H, V)
    g = -F.softplus(torch.randn(b, L, H)) * torch.rand(H) * 2.0  # log decays, some close to 0 and some strong
    beta = torch.sigmoid(torch.randn(b, L, H))
    s0 = torch.randn(b, H, K, V) * 0.5 if init else None
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype), s0


@pytest.mark.parametrize("L", [1, 7, 63, 64, 65, 130])
@pytest.mark.parametrize("Hk,H", [(2, 2), (1, 3)])
def test_chunked_matches_recurrence(L, Hk, H):
    q, k, v, g, beta, s0 = _inputs(2, L, Hk, H, 16, 24)
    o_ref, s_ref = kernels.gated_delta_ref(q, k, v, g, beta, initial_state=s0)
    o, s = kernels.gated_delta_chunk(q, k, v, g, beta, initial_state=s0)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


def test_chunk_size_and_block_change_nothing(monkeypatch):
    """Small chunks and a block boundary inside the sequence (the walk carries the state across blocks)."""
    from hybrid.kernels import gated_delta

    q, k, v, g, beta, s0 = _inputs(1, 100, 2, 2, 8, 8)
    o_ref, s_ref = kernels.gated_delta_ref(q, k, v, g, beta, initial_state=s0)
    monkeypatch.setattr(gated_delta, "_BLOCK", 32)
    o, s = kernels.gated_delta_chunk(q, k, v, g, beta, initial_state=s0, chunk_size=16)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


def test_chunked_matches_recurrence_wide_heads():
    """Heads wide enough that the UT systems' V + K columns take the native solve's 64-column vector passes (and
    its scalar columns past them)."""
    q, k, v, g, beta, s0 = _inputs(1, 130, 2, 4, 64, 96)
    o_ref, s_ref = kernels.gated_delta_ref(q, k, v, g, beta, initial_state=s0)
    with torch.inference_mode():
        o, s = kernels.gated_delta_chunk(q, k, v, g, beta, initial_state=s0)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


def test_step_matches_recurrence_and_split_carries_state():
    q, k, v, g, beta, s0 = _inputs(3, 9, 2, 4, 16, 8)
    o_ref, s_ref = kernels.gated_delta_ref(q, k, v, g, beta, initial_state=s0)
    state = s0.clone()
    ys = [kernels.gated_delta_step(state, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t]) for t in range(9)]
    assert rel_err(torch.stack(ys, 1), o_ref) < 1e-5 and rel_err(state, s_ref) < 1e-5
    o1, s1 = kernels.gated_delta_chunk(q[:, :5], k[:, :5], v[:, :5], g[:, :5], beta[:, :5], initial_state=s0)
    o2, s2 = kernels.gated_delta_chunk(q[:, 5:], k[:, 5:], v[:, 5:], g[:, 5:], beta[:, 5:], initial_state=s1)
    assert rel_err(torch.cat([o1, o2], 1), o_ref) < 1e-5 and rel_err(s2, s_ref) < 1e-5


def test_step_on_pool_slots_and_bf16_state():
    q, k, v, g, beta, s0 = _inputs(2, 1, 2, 2, 8, 8)
    pool = torch.randn(5, 2, 8, 8)
    slots = torch.tensor([3, 1])
    expect = pool[slots].clone()
    low = pool.to(torch.bfloat16)  # the same rows stored in bf16 (before the fp32 pool is stepped)
    y_ref = kernels.gated_delta_step_ref(expect, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
    y = kernels.gated_delta_step(pool, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], slots=slots)
    assert rel_err(y, y_ref) < 1e-5 and rel_err(pool[slots], expect) < 1e-5
    y_low = kernels.gated_delta_step(low, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], slots=slots)
    assert rel_err(y_low, y_ref) < 2e-2 and rel_err(low[slots], expect) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_step_equals_torch_step(dtype):
    """decode.c's step (the CPU default where it builds) against the torch path and the reference: grouped key
    heads, pool slots, fp32 and bf16 inputs and states."""
    from hybrid.kernels import dispatch, native

    if native.available():
        pytest.skip(f"native ops unavailable: {native.available()}")
    q, k, v, g, beta, _ = _inputs(3, 1, 2, 6, 32, 40, dtype=dtype)
    args = (q[:, 0], k[:, 0], v[:, 0], g[:, 0].contiguous(), beta[:, 0].float().contiguous())
    slots = torch.tensor([4, 0, 2])
    for sdt in (torch.float32, torch.bfloat16):
        pool = (torch.randn(5, 6, 32, 40) * 0.5).to(sdt)
        expect = pool[slots].float()
        y_ref = kernels.gated_delta_step_ref(expect, *args, scale=0.3)
        outs = {}
        for name in ("native", "torch"):
            p = pool.clone()
            with dispatch.use_backend(name):
                outs[name] = (kernels.gated_delta_step(p, *args, scale=0.3, slots=slots), p)
        y_n, p_n = outs["native"]
        y_t, p_t = outs["torch"]
        tol = 1e-5 if sdt == dtype == torch.float32 else 2e-2
        assert rel_err(y_n, y_ref) < tol and rel_err(p_n[slots], expect) < tol
        assert rel_err(y_n, y_t) < tol and torch.equal(p_n[[1, 3]], pool[[1, 3]])  # other rows untouched


def _native_builds() -> dict:
    """This CPU's build of decode.c (None: through native.ops) and, where that one has AVX-512, the AVX2 build."""

    builds = {"this CPU's": None}
    if (lib := avx2_build()) is not None:
        builds["AVX2"] = lib
    return builds


def _native_step(lib, pool, q, k, v, g, beta, slots, scale):
    """gated_delta_step through ``lib`` (a build_variant library), or through native.ops where lib is None."""
    from hybrid.kernels import native

    if lib is None:
        return native.ops.gdn_step(pool, q, k, v, g, beta, scale=scale, slots=slots)
    (n, Hk, K), (H, V) = q.shape, v.shape[1:]
    y = torch.empty(n, H, V, dtype=v.dtype)
    codes = native.DTYPE_CODES
    assert lib.hl_gdn_step(pool.data_ptr(), codes[pool.dtype], slots.data_ptr(), q.data_ptr(), k.data_ptr(),
                           q.stride(0), v.data_ptr(), codes[v.dtype], v.stride(0), g.data_ptr(), beta.data_ptr(),
                           g.stride(0), scale, y.data_ptr(), n, H, Hk, K, V) == 0
    return y


@pytest.mark.parametrize("V", [128, 200, 40, 8])
def test_native_step_column_tiles_and_avx2_build(V):
    """decode.c's step in column tiles (AVX-512: 128 columns, AVX2: 32), a part tile and the scalar columns past
    the last full vector, in this CPU's build and the AVX2 one, against the reference: fp32 and bf16 states, pool
    slots, enough heads that the threads' heads are handed out spread over the state."""
    from hybrid.kernels import native

    if native.available():
        pytest.skip(f"native ops unavailable: {native.available()}")
    n, Hk, H, K = 5, 2, 4, 24
    q, k, v, g, beta, _ = _inputs(n, 1, Hk, H, K, V)
    args = (q[:, 0], k[:, 0], v[:, 0], g[:, 0].contiguous(), beta[:, 0].contiguous())
    slots = torch.tensor([6, 0, 2, 5, 3])
    for sdt in (torch.float32, torch.bfloat16):
        pool = (torch.randn(7, H, K, V) * 0.5).to(sdt)
        expect = pool[slots].float()
        y_ref = kernels.gated_delta_step_ref(expect, *args, scale=0.3)
        tol = 1e-5 if sdt == torch.float32 else 2e-2
        for name, lib in _native_builds().items():
            p = pool.clone()
            y = _native_step(lib, p, *args, slots, 0.3)
            assert rel_err(y, y_ref) < tol and rel_err(p[slots], expect) < tol, (name, sdt)
            assert torch.equal(p[[1, 4]], pool[[1, 4]]), (name, sdt)  # rows no slot names untouched


@pytest.mark.parametrize("C,W", [(64, 256), (16, 96), (7, 40), (66, 64)])
def test_native_ut_solve_equals_triangular_solve(C, W):
    """linear_attention.c's forward substitution of the UT systems (64-column AVX-512 passes in 4-row blocks, the
    rows and columns past them one at a time) in this CPU's build and the AVX2 one, and the torch path, against a
    float64 triangular solve; only A's strictly lower part is read."""
    from hybrid.kernels import gated_delta, native

    if native.available():
        pytest.skip(f"native ops unavailable: {native.available()}")
    torch.manual_seed(0)
    k = l2norm(torch.randn(3, C, 32))
    A = (k @ k.transpose(-1, -2)) * torch.rand(3, C, 1)  # beta K K^T's form, the upper part left in (not read)
    X = torch.randn(3, C, W)
    ref = torch.linalg.solve_triangular(A.double().tril(-1) + torch.eye(C, dtype=torch.float64), X.double(),
                                        upper=False)
    for solve in (gated_delta._ut_solve_torch, gated_delta.ut_solve):  # two right-hand sides: each solved
        with torch.inference_mode():
            x1, x2 = solve(A, X[..., :W // 2].clone(), X[..., W // 2:].clone())
        assert rel_err(torch.cat([x1, x2], -1), ref) < 1e-5, solve
    for name, lib in _native_builds().items():
        Y = X.clone()
        if lib is None:
            assert native.ops.gdn_ut_solve(A, Y) is Y
        else:
            lib.hl_gdn_ut_solve(A.data_ptr(), Y.data_ptr(), 3, C, W)
        assert rel_err(Y, ref) < 1e-5, name


@pytest.mark.parametrize("C,K,V,rep", [(64, 128, 128, 2), (16, 24, 40, 3), (7, 16, 8, 1)])
def test_native_chunk_prep_equals_torch(C, K, V, rep):
    """linear_attention.c's pass that builds the walk's operands (the UT solve included) against the torch path's
    ops, in this CPU's build and the AVX2 one: vector rows and scalar tails, one to three value heads a key head."""
    from hybrid.kernels import gated_delta, native

    if native.available():
        pytest.skip(f"native ops unavailable: {native.available()}")
    torch.manual_seed(0)
    n, Hk = 3, 2
    q, k = l2norm(torch.randn(n, Hk, C, K)) * K ** -0.5, l2norm(torch.randn(n, Hk, C, K))
    c = (-F.softplus(torch.randn(n, Hk * rep, C)) * 2.0).cumsum(-1)  # some decays past the e^-80 floor
    beta, v = torch.rand(n, Hk * rep, C), torch.randn(n, Hk * rep, C, V)
    kk, qk = k @ k.transpose(-1, -2), q @ k.transpose(-1, -2)
    with torch.inference_mode():
        ref = gated_delta._chunk_prep_torch(q, k, kk, qk, c, beta, v.clone())
        for name, lib in _native_builds().items():
            if lib is None:
                out = native.ops.gdn_chunk_prep(q, k, kk, qk, c, beta, v.clone())
            else:
                out = (v.clone(), *(torch.empty(n, Hk * rep, C, K) for _ in range(3)), torch.empty(n, Hk * rep, C, C))
                assert lib.hl_gdn_chunk_prep(*(t.data_ptr() for t in (q, k, kk, qk, c, beta, *out)), n, Hk, rep, C,
                                             K, V) == 0
            for what, x, y in zip(("U", "W", "qe", "kend", "attn"), out, ref, strict=True):
                assert rel_err(x, y) < 1e-5, (name, what)


def _rounding_case(v_bits: torch.Tensor, K: int = 4):
    """A step whose new state row 0 is v exactly in fp32 (k = e_0, no decay, beta = 1, row 0 zero), so the stored
    row is v rounded once by the kernel: (q, k, v, g, beta, bf16 pool)."""
    gen = torch.Generator().manual_seed(3)
    n, H, V = v_bits.shape
    v = v_bits.to(torch.int32).view(torch.float32)
    k = torch.zeros(n, H, K)
    k[..., 0] = 1.0
    pool = torch.randn(n, H, K, V, generator=gen).to(torch.bfloat16)
    pool[:, :, 0] = 0
    return torch.randn(n, H, K, generator=gen), k, v, torch.zeros(n, H), torch.ones(n, H), pool


def _check_rounding(lib, case, name):
    q, k, v, g, beta, pool = case
    expect = pool.float()
    kernels.gated_delta_step_ref(expect, q, k, v, g, beta, scale=1.0)
    want = expect.to(torch.bfloat16)  # torch's rounding (nearest even, denormals kept)
    p = pool.clone()
    _native_step(lib, p, q, k, v, g, beta, torch.arange(len(q)), 1.0)
    nan = want.isnan()
    assert torch.equal(p.isnan(), nan), name
    assert torch.equal(p[~nan].view(torch.int16), want[~nan].view(torch.int16)), name
    return want


def test_native_step_rounds_a_bf16_state_as_torch():
    """The bf16 state's one rounding, bit for bit: ties to even both ways, values that round up to infinity, an
    infinity and a NaN (whose columns turn NaN below row 0, as in the reference: 0 * inf)."""
    from hybrid.kernels import native

    if native.available():
        pytest.skip(f"native ops unavailable: {native.available()}")
    bits = torch.randint(0, 2**31, (2, 2, 64), generator=torch.Generator().manual_seed(4), dtype=torch.int64)
    bits = (bits & 0x3FFFFFFF) | 0x3C000000  # ordinary magnitudes, random low bits
    bits[0, 0, :8] = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000,  # ties: down to even, up
                                   0x7F7FFFFF, 0xFF7F8000, 0x7F7F7FFF, 0x00000000])  # to +-inf, the last finite
    bits[1, 0, 40], bits[1, 1, 20] = 0x7FC00001, 0x7F800000
    case = _rounding_case(bits)
    for name, lib in _native_builds().items():
        _check_rounding(lib, case, name)


def test_native_step_keeps_bf16_denormals():
    """Where the FPU keeps denormals, a bf16 state keeps them as torch's rounding does (vcvtneps2bf16, AVX512-BF16's
    conversion, would flush them to zero: the kernel rounds those vectors in integer lanes). The library's
    -ffast-math start-up code sets flush-to-zero and denormals-are-zero for the process, so this runs with both
    cleared, on one thread (a pool worker keeps its own MXCSR), in builds of its own."""
    import ctypes
    import ctypes.util

    from hybrid.kernels import native

    if native.available():
        pytest.skip(f"native ops unavailable: {native.available()}")
    bits = torch.full((1, 2, 48), 0x3E800000, dtype=torch.int64)
    bits[0, 0, :6] = torch.tensor([0x00012345, 0x00018000, 0x00028000, 0x80008001, 0x007FFFFF, 0x0000FFFF])
    bits[0, 1, 16:18] = torch.tensor([0x00400000, 0x80000001])
    case = _rounding_case(bits)
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    env = ctypes.create_string_buffer(64)  # fenv_t, MXCSR included
    builds = {"this CPU's flags": native.build_variant("one_thread", ())}
    if (lib := avx2_build()) is not None:
        builds["AVX2"] = lib
    assert libm.fegetenv(env) == 0
    try:
        torch.set_flush_denormal(False)
        for name, lib in builds.items():
            lib.hl_set_threads(1, 0)
            try:
                want = _check_rounding(lib, case, name).view(torch.int16)
                assert ((want & 0x7F80 == 0) & (want & 0x7F != 0)).sum() >= 6  # denormals, not flushed
            finally:
                lib.hl_set_threads(2, 0)
    finally:
        libm.fesetenv(env)


def test_varlen_equals_each_sequence_alone():
    lens = [5, 64, 70, 1]
    T = sum(lens)
    q, k, v, g, beta, _ = _inputs(1, T, 2, 4, 16, 8)
    s0 = torch.randn(len(lens), 4, 16, 8)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    o, finals = kernels.gated_delta_varlen(q[0], k[0], v[0], g[0], beta[0], cu, initial_states=s0)
    o_ref, f_ref = kernels.gated_delta_varlen_ref(q[0], k[0], v[0], g[0], beta[0], cu, initial_states=s0)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(finals, f_ref) < 1e-5
    for i in range(len(lens)):
        s = slice(int(cu[i]), int(cu[i + 1]))
        oi, fi = kernels.gated_delta_chunk(q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], initial_state=s0[i:i + 1])
        assert torch.allclose(o[s], oi[0], atol=1e-6) and torch.allclose(finals[i], fi[0], atol=1e-6)


def test_bf16_within_bf16_noise_of_fp32_reference():
    """bf16 inputs: the chunked output is as close to the fp32 reference as rounding the fp32 output to bf16
    and feeding bf16-rounded inputs through the exact reference (the noise bf16 itself brings), within 2x."""
    q, k, v, g, beta, s0 = _inputs(1, 150, 2, 2, 32, 32)
    o32, _ = kernels.gated_delta_ref(q, k, v, g, beta, initial_state=s0)
    lo = [t.to(torch.bfloat16) for t in (q, k, v)]
    o16, _ = kernels.gated_delta_chunk(*lo, g, beta.to(torch.bfloat16), initial_state=s0)
    noise_ref, _ = kernels.gated_delta_ref(*lo, g, beta.to(torch.bfloat16), initial_state=s0)
    noise = rel_err(noise_ref, o32)  # the reference on bf16 inputs, output rounded to bf16
    assert o16.dtype == torch.bfloat16
    assert rel_err(o16, o32) <= 2 * noise + 1e-6


def test_bad_shapes_are_refused():
    q, k, v, g, beta, _ = _inputs(1, 4, 2, 3, 8, 8)  # 3 value heads over 2 key heads
    with pytest.raises(ValueError, match="multiple"):
        kernels.gated_delta_chunk(q, k, v, g, beta)


def test_reference_matches_transformers_qwen3_next_torch_path():
    mod = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, g, beta, s0 = _inputs(1, 70, 2, 4, 16, 8)
    o_ref, s_ref = kernels.gated_delta_ref(q, k, v, g, beta, initial_state=s0)
    o_hf, s_hf = mod.torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=s0,
                                                      output_final_state=True)
    assert rel_err(o_hf, o_ref) < 1e-5 and rel_err(s_hf, s_ref) < 1e-5
    o_hc, s_hc = mod.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=s0,
                                                  output_final_state=True)
    assert rel_err(o_hc, o_ref) < 1e-5 and rel_err(s_hc, s_ref) < 1e-5
