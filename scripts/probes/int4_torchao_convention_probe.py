"""Probe (issue 25): does torchao's PrototypeInt4WeightOnlyConfig (Int4OpaqueTensor) fill scale_and_zero with
the convention aten's _weight_int4pack_mm_for_cpu decodes, w = (q - 8) * scale + zero, and how is qdata laid
out when N % 32 == 16? Decodes qdata/scale_and_zero with docs/notes/int4-cpu-layout.md's layout and compares
with (a) the kernel's own product against the identity (its effective weights), (b) torchao's tinygemm
dequantisation of the original weight."""

import torch
from torchao.prototype.quantization.int4 import Int4OpaqueTensor, PrototypeInt4WeightOnlyConfig
from torchao.quantization import quantize_
from torchao.quantization.quant_primitives import (
    MappingType,
    _choose_qparams_affine_tinygemm,
    _dequantize_affine_tinygemm,
    _quantize_affine_tinygemm,
)


def main():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for N, K, group in ((64, 128, 32), (48, 128, 64), (80, 256, 128), (16, 64, 32)):
            lin = torch.nn.Linear(K, N, bias=False).to(dtype)
            w0 = lin.weight.detach().clone()
            cfg = PrototypeInt4WeightOnlyConfig(group_size=group, set_inductor_config=False)
            quantize_(torch.nn.Sequential(lin), cfg)
            t = lin.weight
            assert isinstance(t, Int4OpaqueTensor)
            q, sz = t.qdata, t.scale_and_zero
            print(dtype, N, K, group, "qdata", tuple(q.shape), q.dtype, "sz", tuple(sz.shape), sz.dtype)
            # the kernel's effective weights: x = I_K
            eye = torch.eye(K, dtype=dtype)
            eff = torch.nn.functional.linear(eye, t).float().t()  # [N, K]
            # torchao's own quant primitives on the original weight
            block = [1, group]
            s, z = _choose_qparams_affine_tinygemm(
                w0, MappingType.ASYMMETRIC, block, torch.int32, 0, 15, 1e-6, None, w0.dtype
            )
            codes = _quantize_affine_tinygemm(w0, block, s, z, torch.int32, 0, 15)
            dq = _dequantize_affine_tinygemm(codes, block, s, z, torch.int32, 0, 15, output_dtype=torch.float32)
            # our decoding of qdata with the note's layout, all blocks of 32 and (hypothesis) a tail of 16
            flat = q.contiguous().view(-1)
            nb = N // 32
            mine = torch.empty(N, K, dtype=torch.int32)
            body = flat[: nb * 16 * K].view(nb, K, 16).int()
            mine[: nb * 32] = torch.cat([body & 15, body >> 4], 2).permute(0, 2, 1).reshape(nb * 32, K)
            if N % 32:
                tb = flat[nb * 16 * K :].int()
                # hypothesis 1: [K, 8] bytes, low nibble row i, high row i+8
                h1 = tb.view(K, 8)
                r1 = torch.cat([h1 & 15, h1 >> 4], 1).t()
                # hypothesis 2: [K, 8] bytes, row 2i low, 2i+1 high
                r2 = torch.stack([h1 & 15, h1 >> 4], 2).reshape(K, 16).t()
                ok1 = torch.equal(r1, codes[nb * 32 :].int())
                ok2 = torch.equal(r2, codes[nb * 32 :].int())
                print("  tail: lo=i hi=i+8:", ok1, " lo=2i hi=2i+1:", ok2)
                mine[nb * 32 :] = r1 if ok1 else r2
            print(
                "  codes equal torchao's:",
                torch.equal(mine[: nb * 32], codes[: nb * 32].int()),
                "(all rows:",
                torch.equal(mine, codes.int()),
                ")",
            )
            sc = sz[..., 0].float().t().repeat_interleave(group, 1)  # [N, K]
            ze = sz[..., 1].float().t().repeat_interleave(group, 1)
            deq = (mine.float() - 8) * sc + ze
            print("  |deq - torchao dequant| max", (deq - dq).abs().max().item(), " |dq| max", dq.abs().max().item())
            print("  |deq - kernel effective| max", (deq - eff).abs().max().item())
            x = torch.randn(3, K).to(dtype)
            y = torch.nn.functional.linear(x, t)
            print(
                "  out dtype",
                y.dtype,
                " |y - x@deq^T| max",
                (y.float() - x.float() @ deq.t()).abs().max().item(),
                " vs x bf16:",
                (y.float() - x.bfloat16().float() @ deq.t()).abs().max().item(),
                " |y|max",
                y.abs().max().item(),
            )


main()
