"""One-hot probes of aten's CPU int4pack layout on this machine, checked against the 64-row formula of
docs/notes/int4-cpu-layout.md: byte[nb, k, i] = w[nb*64 + i, k] | (w[nb*64 + 32 + i, k] << 4), i < 32, and the
last N % 64 rows (16, 32 or 48) pairwise, (N % 64) / 2 bytes per k: byte[k, j] = w[base + 2j, k] | (w[base + 2j + 1,
k] << 4). Prints each probe's packed position and whether the formula predicts it; and a random full matrix."""
import torch


def predicted(N, K, n, k, BN=64):
    """(byte index into the flat qdata, nibble 'lo'/'hi') that the 64-row formula puts w[n, k] at."""
    full = N // BN
    if n < full * BN:
        nb, r = divmod(n, BN)
        i, hi = (r, False) if r < BN // 2 else (r - BN // 2, True)
        return (nb * K + k) * (BN // 2) + i, "hi" if hi else "lo"
    t = N % BN
    j, hi = divmod(n - full * BN, 2)
    return full * BN // 2 * K + k * (t // 2) + j, "hi" if hi else "lo"


def where(N, K, n, k):
    w = torch.zeros(N, K, dtype=torch.int32)
    w[n, k] = 1
    p = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w, 1).contiguous().view(-1)
    idx = p.nonzero().view(-1).tolist()
    assert len(idx) == 1, idx
    return idx[0], "lo" if int(p[idx[0]]) == 1 else "hi"


bad = 0
for N, K in ((64, 64), (128, 32), (80, 32), (96, 32), (112, 32), (176, 64)):
    probes = {(0, 0), (0, 1), (1, 0), (31, 0), (32, 0), (33, 0), (63, K - 1), (N - 1, K - 1), (N - 1, 0),
              (N - 2, 3), (N - 16, 1), (N - 15, 2)}
    probes |= {(n, k) for n in range(N) for k in (0, K - 1)}
    for n, k in sorted(probes):
        got, want = where(N, K, n, k), predicted(N, K, n, k)
        bad += got != want
        if got != want or (n, k) in {(0, 0), (32, 0), (N - 1, K - 1)}:
            print(f"N={N} K={K} w[{n},{k}] -> byte {got[0]} {got[1]}; formula {want}")
# whole random matrices: every nibble where the formula puts it
for N, K in ((64, 64), (80, 128), (96, 64), (112, 32), (2064, 64)):
    w = torch.randint(0, 16, (N, K), dtype=torch.int32)
    p = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w, 1).contiguous().view(-1)
    for n in range(N):
        for k in range(0, K, max(1, K // 8)):
            b, nib = predicted(N, K, n, k)
            v = int(p[b]) & 15 if nib == "lo" else int(p[b]) >> 4
            bad += v != int(w[n, k])
    print(f"random N={N} K={K} checked")
print("mismatches:", bad)
