"""Float8 (e4m3) matrix products with a scale per activation row and per weight row:

    quantize_rows(x, act) -> (q, scale)
        a = act(x) in float32, x [M, K]; scale[m] = max(max_k |a[m, k]|, 1e-12) / 448 (float32
        [M, 1]); q[m] = a[m] / scale[m] rounded to float8_e4m3fn (448 is its largest finite value).
        act: "none", "gelu_tanh" or "relu_square": an MLP's activation applied where its second
        projection quantizes its input, so the activation costs no pass over memory of its own.
    fp8_matmul(q, scale, weight, weight_scale, bias, out_dtype) -> out [M, N]
        (q @ weight.T) * scale * weight_scale.T + bias, rounded to out_dtype: the products of the
        float8 values are exact in float32 and summed in float32; weight [N, K] float8_e4m3fn and
        weight_scale [N] float32 come from quantize_weight once at load.

quantize_weight(w) -> (q [N, K], scale [N]) is quantize_rows with no activation (plain torch; it
runs once per weight). The backends run the product on the float8 tensor cores
(torch._scaled_mm: CUTLASS's row-wise scaled kernel on sm90), about twice the bf16 rate.
"""

from __future__ import annotations

import torch

from mstar.ops.activation import _gelu_ref, _relu_square_ref
from mstar.ops.registry import define_op, register_backend

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_FLOOR = 1e-12  # an all-zero row gets this amax: its scale stays finite and its q zero
ACTIVATIONS = ("none", "gelu_tanh", "relu_square")


def apply_activation(x: torch.Tensor, act: str) -> torch.Tensor:
    """act(x) in float32."""
    a = x.float()
    if act == "gelu_tanh":
        return _gelu_ref(a, "tanh")
    if act == "relu_square":
        return _relu_square_ref(a)
    if act != "none":
        raise ValueError(f"quantize_rows: act must be one of {ACTIVATIONS}, got {act!r}")
    return a


def _quantize_rows_ref(x: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """act(x) per row scaled into float8 e4m3's range: (q [M, K] float8_e4m3fn, scale [M, 1] float32)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows: x must be [M, K], got {tuple(x.shape)}")
    a = apply_activation(x, act)
    scale = a.abs().amax(dim=1, keepdim=True).clamp_min(SCALE_FLOOR) / FP8_MAX
    return (a / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _quantize_rows_fake(x, act):
    return x.new_empty(x.shape, dtype=FP8), x.new_empty((x.shape[0], 1), dtype=torch.float32)


quantize_rows = define_op("quantize_rows", "(Tensor x, str act) -> (Tensor, Tensor)",
                          reference=_quantize_rows_ref, fake=_quantize_rows_fake)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear layer's weight [N, K] -> (float8 [N, K], scale [N] float32), one scale per output row."""
    q, scale = _quantize_rows_ref(weight.detach(), "none")
    return q, scale.view(-1)


def check_fp8_matmul(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None) -> None:
    """Raise ValueError (naming the op) unless the shapes and dtypes are fp8_matmul's."""
    M, K = q.shape if q.dim() == 2 else (-1, -1)
    N = weight.shape[0] if weight.dim() == 2 else -1
    ok = q.dim() == 2 and q.dtype == FP8 and weight.dtype == FP8 and weight.shape == (N, K) \
        and scale.shape == (M, 1) and scale.dtype == torch.float32 \
        and weight_scale.shape == (N,) and weight_scale.dtype == torch.float32 \
        and (bias is None or bias.shape == (N,))
    if not ok:
        raise ValueError(f"fp8_matmul: q [M, K] and weight [N, K] float8_e4m3fn, scale [M, 1] and weight_scale [N] "
                         f"float32, bias [N] or None; got q {tuple(q.shape)} {q.dtype}, scale {tuple(scale.shape)} "
                         f"{scale.dtype}, weight {tuple(weight.shape)} {weight.dtype}, weight_scale "
                         f"{tuple(weight_scale.shape)} {weight_scale.dtype}, bias "
                         f"{None if bias is None else tuple(bias.shape)}")


def _fp8_matmul_ref(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """(q @ weight.T) * scale * weight_scale + bias in float32 (the float8 products are exact), rounded once."""
    check_fp8_matmul(q, scale, weight, weight_scale, bias)
    out = (q.float() @ weight.float().t()) * scale * weight_scale
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _fp8_matmul_fake(q, scale, weight, weight_scale, bias, out_dtype):
    return q.new_empty((q.shape[0], weight.shape[0]), dtype=out_dtype)


fp8_matmul = define_op(
    "fp8_matmul", "(Tensor q, Tensor scale, Tensor weight, Tensor weight_scale, Tensor? bias, ScalarType out_dtype) "
    "-> Tensor", reference=_fp8_matmul_ref, fake=_fp8_matmul_fake)



def _has_fp8_tensor_cores() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _fp8_matmul_scaled_mm(q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                          bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """torch._scaled_mm with row-wise scales: the scales and the bias are applied to the float32
    accumulator in the GEMM's epilogue. Its row-wise kernel writes bfloat16 and needs K and N
    multiples of 16; other cases take the reference."""
    check_fp8_matmul(q, scale, weight, weight_scale, bias)
    N, K = weight.shape
    if out_dtype != torch.bfloat16 or K % 16 or N % 16:
        return _fp8_matmul_ref(q, scale, weight, weight_scale, bias, out_dtype)
    return torch._scaled_mm(q.contiguous(), weight.t(), scale_a=scale.contiguous(), scale_b=weight_scale.view(1, N),
                            bias=None if bias is None else bias.to(out_dtype), out_dtype=out_dtype)


register_backend(fp8_matmul, "scaled_mm", _fp8_matmul_scaled_mm, devices=("cuda",), available=_has_fp8_tensor_cores,
                 priority=10, note="torch._scaled_mm, row-wise scales (CUTLASS on sm90), float8 tensor cores")

__all__ = ["quantize_rows", "fp8_matmul"]
