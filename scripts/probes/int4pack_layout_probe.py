import torch

N, K = 64, 64


def where(n, k):
    w = torch.zeros(N, K, dtype=torch.int32)
    w[n, k] = 1
    p = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w, 1)
    idx = (p != 0).nonzero()[0].tolist()
    b = int(p[idx[0], idx[1]])
    return idx, "lo" if b == 1 else "hi"


for n, k in [(0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (31, 0), (32, 0), (33, 0), (0, 63), (47, 5), (63, 63)]:
    print((n, k), "->", where(n, k))
