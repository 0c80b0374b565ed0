"""Float8 linear layers against bf16 ones at the denoising transformers' shapes (MSTAR_DIT_FP8), on
one CUDA GPU with float8 tensor cores (sm89+), random inputs:

    python -m mstar.bench.tools.probe_fp8

Per shape: `F.linear` in bf16; `quantize_rows` alone (with the MLP activation the layer applies to
its input); `fp8_matmul` alone, and `torch._scaled_mm` with fast accumulation for comparison; the
whole float8 layer (quantize + product) and its speed-up over bf16; and, for shapes without an
activation, the float8 output's relative L2 error against the bf16 one. Results: notes/dit-fp8.md.
"""

from __future__ import annotations

import torch
import triton

from mstar import ops
from mstar.ops.fp8 import quantize_weight

SHAPES = (  # (label, M tokens, N out, K in, activation of the input)
    ("wan q/k/v/o", 7020, 3072, 3072, "none"),
    ("wan ffn up", 7020, 14336, 3072, "none"),
    ("wan ffn down (gelu)", 7020, 3072, 14336, "gelu_tanh"),
    ("cosmos3 video q/k/v", 18720, 4096, 2048, "none"),
    ("cosmos3 video o", 18720, 2048, 2048, "none"),
    ("cosmos3 video up", 18720, 9216, 2048, "none"),
    ("cosmos3 video down (relu2)", 18720, 2048, 9216, "relu_square"),
    ("cosmos3 image up", 800, 9216, 2048, "none"),
)


def _us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200) * 1e3


def main() -> None:
    torch.manual_seed(0)
    print(torch.cuda.get_device_name())
    for label, M, N, K, act in SHAPES:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        wq, ws = quantize_weight(w)
        q, s = ops.quantize_rows(x, act)
        bf16 = _us(lambda: torch.nn.functional.linear(x, w, b))
        quant = _us(lambda: ops.quantize_rows(x, act))
        mm = _us(lambda: ops.fp8_matmul(q, s, wq, ws, b, torch.bfloat16))
        fast = _us(lambda: torch._scaled_mm(q, wq.t(), scale_a=s, scale_b=ws.view(1, -1), bias=b,
                                            out_dtype=torch.bfloat16, use_fast_accum=True))
        layer = _us(lambda: ops.fp8_matmul(*ops.quantize_rows(x, act), wq, ws, b, torch.bfloat16))
        tflops = lambda us: 2 * M * N * K / us / 1e6  # noqa: E731
        err = ""
        if act == "none":
            ref = torch.nn.functional.linear(x, w, b).float()
            got = ops.fp8_matmul(q, s, wq, ws, b, torch.bfloat16).float()
            err = f" relerr {((got - ref).norm() / ref.norm()).item():.4f}"
        print(f"{label:28s} bf16 {bf16:8.1f} us ({tflops(bf16):5.0f} TF/s) | quant {quant:6.1f} us "
              f"({M * K * 3 / quant / 1e3:5.0f} GB/s) | fp8 mm {mm:8.1f} us ({tflops(mm):5.0f}) fast-accum "
              f"{fast:8.1f} us ({tflops(fast):5.0f}) | quant+mm {layer:8.1f} us = {bf16 / layer:4.2f}x bf16{err}")


if __name__ == "__main__":
    main()
