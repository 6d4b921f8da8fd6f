import torch

N, K, G = 32, 32, 32
w = torch.full((N, K), 3, dtype=torch.int32)
p = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w, 1)
sz = torch.zeros(K // G, N, 2, dtype=torch.bfloat16)
sz[..., 0] = 2.0
sz[..., 1] = 0.5
x = torch.zeros(1, K, dtype=torch.bfloat16)
x[0, 0] = 1
y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, G, sz)
print("q=3 scale=2 zero=0.5 ->", y[0, 0].item(), "(q-8)*s+z=", (3 - 8) * 2 + 0.5, "q*s+z=", 3 * 2 + 0.5)
