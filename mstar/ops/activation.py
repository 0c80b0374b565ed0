"""Activation ops: the gated SiLU of SwiGLU MLPs, GELU, a linear layer followed by GELU, and
relu(x)^2 (the squared-ReLU MLPs).
They compute the activation in float32 and return the input dtype; outputs are always fresh
contiguous tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mstar.ops.registry import define_op, register_backend


def _silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for x of shape [..., 2d] (SwiGLU: gate first, up second)."""
    d = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype).contiguous()


def _silu_and_mul_fake(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


silu_and_mul = define_op("silu_and_mul", "(Tensor x) -> Tensor",
                         reference=_silu_and_mul_ref, fake=_silu_and_mul_fake)


def _sigmoid_mul_ref(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) ([T, H, D] each, any strides; an attention's output gate), the sigmoid
    rounded to gate's dtype first, as torch computes it -> a fresh contiguous tensor."""
    return (x * torch.sigmoid(gate)).contiguous()


sigmoid_mul = define_op("sigmoid_mul", "(Tensor x, Tensor gate) -> Tensor", reference=_sigmoid_mul_ref,
                        fake=lambda x, gate: torch.empty_like(x, memory_format=torch.contiguous_format))


def _relu_square_ref(x: torch.Tensor) -> torch.Tensor:
    """relu(x) ** 2 in x's dtype (one rounding of the square: exact in float32 for bf16 / fp16 x)."""
    return F.relu(x).square()


relu_square = define_op("relu_square", "(Tensor x) -> Tensor", reference=_relu_square_ref,
                        fake=lambda x: torch.empty_like(x, memory_format=torch.contiguous_format))


def _gelu_ref(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """GELU; approximate is "none" (exact, erf) or "tanh"."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return F.gelu(x.float(), approximate=approximate).to(x.dtype).contiguous()


def _gelu_fake(x, approximate):
    return x.new_empty(x.shape)


gelu = define_op("gelu", "(Tensor x, str approximate) -> Tensor", reference=_gelu_ref, fake=_gelu_fake)



def _linear_gelu_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, approximate: str) -> torch.Tensor:
    """gelu(x @ weight.T + bias): the product rounded to x's dtype, then GELU in float32."""
    return _gelu_ref(F.linear(x, weight, bias), approximate)


def _linear_gelu_fake(x, weight, bias, approximate):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _linear_gelu_cublaslt(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, approximate: str) -> torch.Tensor:
    """cuBLASLt's GEMM with the bias + GELU (tanh) epilogue: GELU is applied to the float32
    accumulator before the single rounding, so no activation pass over the product is made."""
    if approximate != "tanh":
        return _linear_gelu_ref(x, weight, bias, approximate)
    x2 = x.reshape(-1, x.shape[-1])
    return torch._addmm_activation(bias, x2, weight.t(), use_gelu=True).view(*x.shape[:-1], weight.shape[0])


linear_gelu = define_op("linear_gelu", "(Tensor x, Tensor weight, Tensor bias, str approximate) -> Tensor",
                        reference=_linear_gelu_ref, fake=_linear_gelu_fake)
register_backend(linear_gelu, "cublaslt", _linear_gelu_cublaslt, devices=("cuda",), available=torch.cuda.is_available,
                 priority=10, note="one cuBLASLt GEMM with the bias + GELU-tanh epilogue (torch._addmm_activation)")

__all__ = ["silu_and_mul", "sigmoid_mul", "relu_square", "gelu", "linear_gelu"]
