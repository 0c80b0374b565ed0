"""Linear layers in float8 e4m3 (ops.quantize_rows / ops.fp8_matmul): the weight quantized once
with a scale per output row, the input quantized per row at each call.

    Fp8Linear.of(linear)      from an nn.Linear (its bf16 weight is dropped with it)
    layer(x, act)             act(x) @ W.T + b; act as ops.quantize_rows takes it ("none",
                              "gelu_tanh", "relu_square"): the MLP's activation runs in the
                              second projection's quantize kernel
    project(x, *layers)       x through several layers, quantized once when they are Fp8Linear
    to_fp8(module, names)     swap the nn.Linear submodules at these dotted names
    apply_dit_fp8(transformer)  a denoising transformer's to_fp8() when MSTAR_DIT_FP8 is on
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from mstar import ops
from mstar.ops.fp8 import quantize_weight


class Fp8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        q, scale = quantize_weight(weight)
        self.register_buffer("weight", q)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.out_dtype = weight.dtype

    @classmethod
    def of(cls, linear: nn.Linear) -> "Fp8Linear":
        return cls(linear.weight, linear.bias)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def quantize(self, x: torch.Tensor, act: str = "none") -> tuple[torch.Tensor, torch.Tensor]:
        return ops.quantize_rows(x.reshape(-1, x.shape[-1]), act)

    def apply_quantized(self, xq: tuple[torch.Tensor, torch.Tensor], lead: tuple[int, ...]) -> torch.Tensor:
        """The product of an input quantize() made; lead: the input's leading dims."""
        out = ops.fp8_matmul(*xq, self.weight, self.weight_scale, self.bias, self.out_dtype)
        return out.view(*lead, self.out_features)

    def forward(self, x: torch.Tensor, act: str = "none") -> torch.Tensor:
        return self.apply_quantized(self.quantize(x, act), x.shape[:-1])

    def extra_repr(self) -> str:
        n, k = self.weight.shape
        return f"in={k}, out={n}, bias={self.bias is not None}, float8_e4m3fn"


def project(x: torch.Tensor, *layers: nn.Module) -> tuple[torch.Tensor, ...]:
    """Each layer of x; Fp8Linear layers share one quantization of x."""
    if all(isinstance(m, Fp8Linear) for m in layers):
        xq = layers[0].quantize(x)
        return tuple(m.apply_quantized(xq, x.shape[:-1]) for m in layers)
    return tuple(m(x) for m in layers)


def to_fp8(module: nn.Module, names: Iterable[str]) -> None:
    """Replace the nn.Linear submodules of `module` at these dotted names by Fp8Linear."""
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        linear = getattr(parent, child)
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"to_fp8: {name} is {type(linear).__name__}, not nn.Linear")
        setattr(parent, child, Fp8Linear.of(linear))


def apply_dit_fp8(transformer):
    """transformer with its blocks' linear layers in float8 (its to_fp8) when MSTAR_DIT_FP8 is on.
    A GPU without float8 tensor cores is refused: there the products would run in float32."""
    from mstar import knobs
    if not knobs.value("MSTAR_DIT_FP8"):
        return transformer
    dev = transformer.device
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (8, 9):
        raise ValueError(f"MSTAR_DIT_FP8 needs float8 tensor cores (compute capability 8.9 or newer); "
                         f"{torch.cuda.get_device_name(dev)} has {torch.cuda.get_device_capability(dev)}")
    return transformer.to_fp8()
