"""Tensor-parallel state of this process and the sharding arithmetic of the models.

A tensor-parallel run has one process per rank; the runtime builds each rank's model
inside `building(rank, size, group)` (followers may simply `set_tp`), and the layers read
`tp_rank()` / `tp_size()` / the group once, at construction, to size their shards:

  * column-parallel linears (q/k/v, gate/up, GDN in_proj_*) keep a contiguous block of
    heads (or intermediate features) of every fused part, so the checkpoint's tensors
    load unchanged, each rank reading only its slice (layers.ShardInfo);
  * row-parallel linears (o_proj, out_proj, down_proj) keep the matching input columns
    and all-reduce their output: exactly one all-reduce after each mixer and each MLP;
  * the embedding and the LM head are split over the vocabulary (padded to a multiple
    of the world size): the embedding masks ids outside its range and all-reduces, the
    head all-gathers the logits;
  * KV heads: split when tp divides them, replicated (rank r keeps KV head
    r // (tp / num_kv_heads)) when num_kv_heads divides tp; anything else is refused.

With tp = 1 (the default, and every process that never calls set_tp) the layers build
exactly the tensors and run exactly the code of the single-device model: no
collective, no extra op.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch


@dataclass(frozen=True)
class TPState:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup (None: the default group)


_STATE = TPState()


def set_tp(rank: int, size: int, group: Any = None) -> None:
    """Make this process rank `rank` of `size` (torch.distributed must be initialised when size > 1)."""
    global _STATE
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"tensor parallel: bad rank {rank} of {size}")
    _STATE = TPState(int(rank), int(size), group)


def reset_tp() -> None:
    set_tp(0, 1, None)


def get_tp() -> TPState:
    return _STATE


def tp_rank() -> int:
    return _STATE.rank


def tp_size() -> int:
    return _STATE.size


@contextlib.contextmanager
def building(rank: int, size: int, group: Any = None) -> Iterator[None]:
    """Models built inside this block are rank `rank` of `size`. Layers keep what they
    read at construction, so a process may hold a sharded model (a tensor-parallel
    engine's rank 0) and unsharded ones (a tp = 1 engine) side by side."""
    global _STATE
    saved = _STATE
    set_tp(rank, size, group)
    try:
        yield
    finally:
        _STATE = saved


def single_rank():
    """Build unsharded modules inside this block (e.g. the full model of a tiny preset)."""
    return building(0, 1, None)


# --- collectives (only called when size > 1) ------------------------------------------------------
# Layers call these only when their own tp size (read at construction) is > 1, with the
# group they captured then.
# A faster sum for the default group that the runtime may install once the process group is up
# (runtime/parallel/tp_allreduce.py): called with x, it sums in place and returns True, or returns False
# for a tensor it does not take (dtype, size), which then goes through torch.distributed.
_FAST_ALL_REDUCE: list = [None]


def install_all_reduce(fn: Any) -> None:
    """Install (or, with None, remove) the default group's fast all-reduce."""
    _FAST_ALL_REDUCE[0] = fn


# Set by the runtime (tp_allreduce.py) when the all-reduce can be fused with the residual add +
# RMSNorm that follows every row-parallel output: fn(x, residual, weight, eps, zero_centered, site)
# -> (normed, new residual), or None for a tensor it does not take.
_FUSED_REDUCE_NORM: list = [None]


def install_fused_reduce_norm(fn: Any) -> None:
    """Install (or, with None, remove) the default group's fused all-reduce + add + RMSNorm."""
    _FUSED_REDUCE_NORM[0] = fn


def fused_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                              zero_centered: bool, site: int, group: Any = None):
    """(rms_norm(sum_ranks(x) + residual), sum_ranks(x) + residual) in one kernel, or None (nothing
    done: the caller all-reduces and norms). site: the position of this sum in the forward (the
    fused kernel alternates buffers between consecutive sites)."""
    fused = _FUSED_REDUCE_NORM[0]
    if fused is None or group is not None:
        return None
    return fused(x, residual, weight, eps, zero_centered, site)


def all_reduce(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum over the group's ranks, in place; returns x."""
    fast = _FAST_ALL_REDUCE[0]
    if fast is not None and group is None and fast(x):
        return x
    import torch.distributed as dist
    dist.all_reduce(x, group=group)
    return x


def all_gather_last(x: torch.Tensor, size: int, group: Any = None) -> torch.Tensor:
    """Concatenate every rank's x along the last dim (rank order)."""
    import torch.distributed as dist
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


def vocab_parallel_argmax(local: torch.Tensor, vocab_size: int, rank: int, size: int,
                          group: Any = None) -> torch.Tensor:
    """argmax over the full vocabulary of the row-wise logits whose rank-`rank` shard of
    columns is `local` [B, V / size] (rank order, padding past vocab_size), without gathering
    them: each rank's best (value, id) of its shard, one all-gather of those pairs, the best per
    row. Ties go to the lowest id, as torch.argmax of the gathered logits does. int64 [B]."""
    import torch.distributed as dist
    width = local.shape[-1]
    start = rank * width
    valid = max(0, min(width, vocab_size - start))
    pair = torch.full((local.shape[0], 2), float("-inf"), dtype=torch.float32, device=local.device)
    if valid:
        shard = local[:, :valid]
        idx = shard.argmax(dim=-1, keepdim=True)
        pair[:, :1] = shard.gather(-1, idx).float()  # exact: the logits' own dtype widened
        pair[:, 1:] = (idx + start).float()  # ids < 2**24: exact in float32
    parts = torch.empty((size * pair.shape[0], 2), dtype=pair.dtype, device=pair.device)
    # rank-major rows (gloo takes no stacked shape); all_gather_single is the newer torch's name
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(parts, pair, group=group)
    parts = parts.view(size, -1, 2)
    best = parts[:, :, 0].argmax(dim=0, keepdim=True)  # the first (lowest) rank among equals
    return parts[:, :, 1].gather(0, best).squeeze(0).long()


# --- sharding arithmetic --------------------------------------------------------------------------
def divide(n: int, size: int, what: str) -> int:
    if n % size:
        raise ValueError(f"tensor parallel size {size} must divide {what} ({n})")
    return n // size


def block(n: int, rank: int, size: int, what: str) -> tuple[int, int]:
    """(start, length) of rank's contiguous block of n items split evenly."""
    k = divide(n, size, what)
    return rank * k, k


def kv_heads(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """(first KV head, number of KV heads) a rank keeps: split when size divides them,
    one replicated head per rank when num_kv_heads divides size."""
    if num_kv_heads % size == 0:
        k = num_kv_heads // size
        return rank * k, k
    if size % num_kv_heads == 0:
        return rank // (size // num_kv_heads), 1
    raise ValueError(f"tensor parallel size {size} must divide num_key_value_heads ({num_kv_heads}) "
                     f"or be a multiple of it")


def vocab_block(vocab: int, rank: int, size: int) -> tuple[int, int, int]:
    """(start, valid rows, padded rows per rank) of the vocabulary split."""
    per = -(-vocab // size)
    start = min(rank * per, vocab)
    return start, min(per, vocab - start), per


def check_config(config, size: int) -> None:
    """ValueError naming the offending head count when `size` cannot split the model."""
    if size == 1:
        return
    problems = []
    mt = getattr(config, "model_type", "")
    if mt not in ("qwen3_5_text", "qwen3_5", "qwen3", "llama"):
        raise ValueError(f"tp: tensor parallelism supports Qwen3.5, Qwen3 and Llama models, not {mt!r}")
    h = config.num_attention_heads
    kv = config.num_key_value_heads
    if h % size:
        problems.append(f"num_attention_heads ({h})")
    if kv % size and size % kv:
        problems.append(f"num_key_value_heads ({kv}; or be a multiple of it)")
    if config.intermediate_size % size:
        problems.append(f"intermediate_size ({config.intermediate_size})")
    if mt.startswith("qwen3_5"):
        types = set(getattr(config, "layer_types", ()) or ())
        if "linear_attention" in types:
            if config.linear_num_key_heads % size:
                problems.append(f"linear_num_key_heads ({config.linear_num_key_heads}, the GDN key heads)")
            if config.linear_num_value_heads % size:
                problems.append(f"linear_num_value_heads ({config.linear_num_value_heads}, the GDN value heads)")
    if problems:
        raise ValueError(f"tp: tensor parallel size {size} must divide " + ", ".join(problems))
