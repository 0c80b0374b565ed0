"""Checkpoint-name weight map: where each checkpoint tensor goes (a fused matrix's rows, a
tensor-parallel shard), for the loader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn


@dataclass(frozen=True)
class ShardInfo:
    """Tensor parallel: the part of a checkpoint tensor of shape `full_shape` this rank
    holds. `pieces` are (source start, destination start, length) along `dim`; rows of
    the destination from `pad_from` on (dim 0) are padding, zeroed at load."""

    full_shape: tuple[int, ...]
    dim: int
    pieces: tuple[tuple[int, int, int], ...]
    pad_from: int | None = None


def set_shard(module: nn.Module, pname: str, full_shape: Sequence[int], pieces, dim: int = 0,
              pad_from: int | None = None) -> None:
    """Declare that `module.<pname>` holds a shard of the checkpoint tensor (see ShardInfo)."""
    shards = module.__dict__.setdefault("tp_shards", {})
    shards[pname] = ShardInfo(tuple(int(x) for x in full_shape), dim,
                              tuple((int(a), int(b), int(c)) for a, b, c in pieces), pad_from)


def _src_shape(src) -> tuple[int, ...]:
    return tuple(src.shape) if isinstance(src, torch.Tensor) else tuple(src.get_shape())


def _src_part(src, dim: int, start: int, length: int) -> torch.Tensor:
    """src.narrow(dim, start, length) of a tensor, or the same read from a lazy
    safetensors slice (only that part is read from disk)."""
    if isinstance(src, torch.Tensor):
        return src.narrow(dim, start, length)
    idx = [slice(None)] * len(src.get_shape())
    idx[dim] = slice(start, start + length)
    return src[tuple(idx)]


@dataclass
class WeightSlot:
    """Where one checkpoint tensor goes: rows [offset, offset + rows) of `param`
    (rows = None: the whole parameter); `shard`: only part of it (tensor parallel)."""

    param: torch.Tensor
    offset: int = 0
    rows: int | None = None
    shard: ShardInfo | None = None

    def target(self) -> torch.Tensor:
        if self.rows is None:
            return self.param
        return self.param.narrow(0, self.offset, self.rows)

    @property
    def shape(self) -> tuple[int, ...]:
        """The checkpoint tensor's shape."""
        if self.shard is not None:
            return self.shard.full_shape
        if self.rows is None:
            return tuple(self.param.shape)
        return (self.rows, *self.param.shape[1:])

    def source_shape(self, src) -> tuple[int, ...]:
        return _src_shape(src)

    def load(self, src) -> None:
        """Copy (this rank's part of) the checkpoint tensor `src` into the parameter."""
        sh = self.shard
        if sh is None:
            if not isinstance(src, torch.Tensor):
                src = src[:]
            self.target().copy_(src)
            return
        dst = self.target()
        if sh.pad_from is not None and sh.pad_from < dst.shape[0]:
            dst.narrow(0, sh.pad_from, dst.shape[0] - sh.pad_from).zero_()
        for s, d, n in sh.pieces:
            if n > 0:
                dst.narrow(sh.dim, d, n).copy_(_src_part(src, sh.dim, s, n))


def weight_map(module: nn.Module) -> dict[str, WeightSlot]:
    """{checkpoint tensor name: WeightSlot} for every parameter under `module`.

    Parameters map to their own qualified name, except those of a FusedLinear, which map
    from the names of the checkpoint tensors it fuses.
    """
    from mstar.models.layers.linear import FusedLinear  # (linear.py imports set_shard from here)
    out: dict[str, WeightSlot] = {}
    fused_params: set[int] = set()
    for prefix, mod in module.named_modules():
        if isinstance(mod, FusedLinear):
            base = prefix.rsplit(".", 1)[0] + "." if "." in prefix else ""
            off = 0
            for i, (shard, rows) in enumerate(zip(mod.shard_names, mod.shard_sizes)):
                ws = wb = None
                if mod.sources is not None:
                    full, pieces = mod.sources[i]
                    ws = ShardInfo((full, mod.weight.shape[1]), 0, pieces)
                    wb = ShardInfo((full,), 0, pieces)
                out[f"{base}{shard}.weight"] = WeightSlot(mod.weight, off, rows, ws)
                if mod.bias is not None:
                    out[f"{base}{shard}.bias"] = WeightSlot(mod.bias, off, rows, wb)
                off += rows
            fused_params.add(id(mod.weight))
            if mod.bias is not None:
                fused_params.add(id(mod.bias))
    shards: dict[int, ShardInfo] = {}
    for mod in module.modules():
        for pname, info in mod.__dict__.get("tp_shards", {}).items():
            p = getattr(mod, pname, None)
            if p is not None:
                shards[id(p)] = info
    for name, p in module.named_parameters():
        if id(p) not in fused_params:
            out[name] = WeightSlot(p, shard=shards.get(id(p)))
    return out


