"""Building blocks shared by mstar's models, written against `mstar.ops` and plain torch.

Parameter names follow the Hugging Face checkpoints so that most weights load by name.
Where we fuse several checkpoint tensors into one matrix (q/k/v, gate/up, ...),
`FusedLinear` records which rows of the fused weight each checkpoint tensor fills; the
weight map (`weight_map`) turns that into {checkpoint name: destination} for the loader.

Every forward takes the flattened tokens of one step ([T, ...], decode rows first, see
context.py) and calls the *_decode op on the first `num_decode_tokens` rows and the
*_prefill op on the rest, skipping a part that is empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mstar import ops
from mstar.models import parallel
from mstar.models.context import AttentionLayerSpec, ForwardContext


# --- weight map -------------------------------------------------------------------------------
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


# --- linear layers ----------------------------------------------------------------------------
def _part_source(src, rows: int) -> tuple[int, tuple[tuple[int, int, int], ...]]:
    """A FusedLinear part's source, (first, checkpoint rows) or (checkpoint rows, pieces), as the
    latter."""
    a, b = src
    if isinstance(b, (tuple, list)):
        return int(a), tuple((int(x), int(y), int(z)) for x, y, z in b)
    return int(b), ((int(a), 0, rows),)


class FusedLinear(nn.Module):
    """One matmul for several checkpoint projections of the same input.

    `shard_names` are the checkpoint modules fused here (relative to the parent module,
    e.g. ("q_proj", "k_proj", "v_proj")), `shard_sizes` their output features, stacked
    along the output dim in that order.
    """

    def __init__(self, in_features: int, shard_names: Sequence[str], shard_sizes: Sequence[int],
                 bias: bool = False, sources: Sequence | None = None):
        """`sources` (tensor parallel): per part, (first row taken, rows of the checkpoint
        tensor): the part holds checkpoint rows [first, first + shard_size); or (rows of the
        checkpoint tensor, pieces): ShardInfo pieces (source row, row in the part, rows), for a
        part gathered from several ranges. None: whole."""
        super().__init__()
        self.shard_names = tuple(shard_names)
        self.shard_sizes = tuple(int(s) for s in shard_sizes)
        # kept as (checkpoint rows, pieces) per part
        self.sources = None if sources is None else tuple(
            _part_source(src, n) for src, n in zip(sources, self.shard_sizes))
        out = sum(self.shard_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.weight.shape[1]}, shards={dict(zip(self.shard_names, self.shard_sizes))}"


class Linear(nn.Module):
    """nn.Linear without the init (weights come from a checkpoint or `init_random`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(Linear):
    """Linear whose input features are split over the tensor-parallel ranks: each rank
    multiplies its columns and the partial outputs are summed (one all-reduce), then the
    bias is added. tp = 1: exactly Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        size, rank = parallel.tp_size(), parallel.tp_rank()
        start, local = parallel.block(in_features, rank, size, "the input features of a row-parallel linear")
        super().__init__(local, out_features, bias)
        self.tp_size, self.tp_group = size, parallel.get_tp().group
        self.deferred = False  # defer_reduce()
        if size > 1:
            set_shard(self, "weight", (out_features, in_features), ((start, 0, local),), dim=1)

    def defer_reduce(self) -> None:
        """Return the rank's partial sum: the consumer (an RMSNorm after reduce_input()) sums it."""
        if self.bias is not None:
            raise ValueError("a row-parallel linear with a bias cannot leave its sum to the next norm")
        self.deferred = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x, self.weight)
        if self.deferred:
            return y
        y = parallel.all_reduce(y, self.tp_group)
        return y if self.bias is None else y + self.bias


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class VocabParallelEmbedding(Embedding):
    """Embedding split over the ranks by vocabulary rows (padded to a multiple of the world
    size): a rank looks up the ids it holds, zeros the others, and the ranks all-reduce.
    The weight doubles as the tied LM head's shard. tp = 1: exactly Embedding."""

    def __init__(self, num_embeddings: int, dim: int):
        size, rank = parallel.tp_size(), parallel.tp_rank()
        start, valid, per = parallel.vocab_block(num_embeddings, rank, size)
        super().__init__(per if size > 1 else num_embeddings, dim)
        self.tp_size, self.tp_group = size, parallel.get_tp().group
        self.vocab_size = num_embeddings
        self.vocab_start, self.vocab_valid = start, valid
        if size > 1:
            set_shard(self, "weight", (num_embeddings, dim), ((start, 0, valid),),
                      pad_from=valid if valid < per else None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_valid)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return parallel.all_reduce(h.masked_fill_(outside.unsqueeze(-1), 0.0), self.tp_group)


class ParallelLMHead(Linear):
    """The untied LM head, split by vocabulary rows like VocabParallelEmbedding (the
    model all-gathers the logits). tp = 1: exactly Linear(hidden, vocab)."""

    def __init__(self, hidden: int, vocab: int):
        size, rank = parallel.tp_size(), parallel.tp_rank()
        start, valid, per = parallel.vocab_block(vocab, rank, size)
        super().__init__(hidden, per if size > 1 else vocab)
        if size > 1:
            set_shard(self, "weight", (vocab, hidden), ((start, 0, valid),),
                      pad_from=valid if valid < per else None)


class ParamHolder(nn.Module):
    """A module that only holds `weight` (e.g. a conv weight used through an op)."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))


# --- norms ------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """RMSNorm over the last dim; zero_centered: weight w acts as (1 + w) (Qwen3.5)."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = float(eps)
        self.zero_centered = bool(zero_centered)
        self.reduce_site: int | None = None  # reduce_input()

    def reduce_input(self, site: int, group=None) -> None:
        """At tp > 1: add_forward's x is a row-parallel partial sum (the producer deferred its
        all-reduce), summed here, fused with the add and the norm when the runtime installed a
        kernel for it. site: the sum's position in the forward."""
        self.reduce_site, self.reduce_group = site, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, self.zero_centered)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); residual None: (norm(x), x)."""
        if self.reduce_site is not None:
            fused = parallel.fused_reduce_add_rms_norm(x, residual, self.weight, self.eps, self.zero_centered,
                                                       self.reduce_site, self.reduce_group)
            if fused is not None:
                return fused
            x = parallel.all_reduce(x, self.reduce_group)
        if residual is None:
            return self.forward(x), x
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps, self.zero_centered)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, zero_centered={self.zero_centered}"


# --- MLP --------------------------------------------------------------------------------------
class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate and up are one fused matmul."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu"):
        super().__init__()
        if act != "silu":
            raise ValueError(f"unsupported MLP activation {act!r} (only silu)")
        size, rank = parallel.tp_size(), parallel.tp_rank()
        start, local = parallel.block(intermediate, rank, size, "intermediate_size")
        sources = None if size == 1 else ((start, intermediate), (start, intermediate))
        self.gate_up_proj = FusedLinear(hidden, ("gate_proj", "up_proj"), (local, local), sources=sources)
        self.down_proj = RowParallelLinear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


# --- rotary -----------------------------------------------------------------------------------
def rope_settings(config) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from a transformers config (v5 rope_parameters
    or the older top-level fields)."""
    rp = getattr(config, "rope_parameters", None) or {}
    if not isinstance(rp, dict):
        rp = dict(rp)
    theta = rp.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    factor = rp.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    rtype = rp.get("rope_type", rp.get("type", "default"))
    if rtype not in ("default", None):
        raise ValueError(f"rope_type {rtype!r} is not supported (only default RoPE)")
    return float(theta), float(factor)


class RotaryCache(nn.Module):
    """Holds the [max_pos, rotary_dim] f32 cos|sin table as a non-persistent buffer."""

    def __init__(self, max_positions: int, rotary_dim: int, base: float):
        super().__init__()
        self.max_positions = int(max_positions)
        self.rotary_dim = int(rotary_dim)
        self.base = float(base)
        self.register_buffer("cos_sin_cache", torch.empty(self.max_positions, self.rotary_dim,
                                                          dtype=torch.float32), persistent=False)

    def _apply(self, fn, recurse=True):
        # .to(dtype) / .half() on the model must not round the table: rebuild it in float32
        super()._apply(fn, recurse)
        if self.cos_sin_cache.dtype != torch.float32:
            if self.cos_sin_cache.is_meta:
                self.cos_sin_cache = self.cos_sin_cache.to(torch.float32)
            else:
                self.rebuild()
        return self

    def rebuild(self, device: torch.device | str | None = None) -> None:
        dev = device if device is not None else self.cos_sin_cache.device
        if torch.device(dev).type == "meta":
            return
        self.cos_sin_cache = ops.build_cos_sin_cache(self.max_positions, self.rotary_dim, self.base,
                                                     device=dev).to(torch.float32)


# --- paged attention --------------------------------------------------------------------------
def paged_attention(ctx: ForwardContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
    """Write this step's K/V into the paged cache, then attend: [T, Hq, D] -> [T, Hq, D]."""
    md = ctx.attn
    ops.kv_append(k, v, k_cache, v_cache, md.slot_mapping)
    nd = ctx.num_decode_tokens
    t = q.shape[0]
    parts = []
    if nd > 0:
        parts.append(ops.paged_attention_decode(q[:nd], k_cache, v_cache, md.decode_kv_indptr,
                                                md.decode_kv_indices, md.decode_kv_last_page_len, scale))
    if t > nd:
        parts.append(ops.paged_attention_prefill(q[nd:], k_cache, v_cache, md.prefill_qo_indptr,
                                                 md.prefill_kv_indptr, md.prefill_kv_indices,
                                                 md.prefill_kv_last_page_len, scale))
    if not parts:
        return q.new_empty(q.shape)
    return parts[0] if len(parts) == 1 else torch.cat(parts, 0)


class QKNormAttention(nn.Module):
    """Full causal attention with per-head q/k RMSNorm, (partial) NeoX RoPE and GQA over a
    paged KV cache (Qwen3, Qwen3.5). `output_gate`: q_proj also yields a per-head gate
    (checkpoint layout per head: [query D | gate D]) applied as sigmoid before o_proj."""

    def __init__(self, *, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 zero_centered_norm: bool, output_gate: bool, bias: bool = False):
        super().__init__()
        size, rank = parallel.tp_size(), parallel.tp_rank()
        # tensor parallel: this rank's query heads and the KV heads they read
        q_start, self.num_heads = parallel.block(num_heads, rank, size, "num_attention_heads")
        kv_start, self.num_kv_heads = parallel.kv_heads(num_kv_heads, rank, size)
        self.head_dim = head_dim
        self.output_gate = output_gate
        per_head = head_dim * (2 if output_gate else 1)
        q_rows = self.num_heads * per_head
        kv_rows = self.num_kv_heads * head_dim
        sources = None if size == 1 else ((q_start * per_head, num_heads * per_head),
                                          (kv_start * head_dim, num_kv_heads * head_dim),
                                          (kv_start * head_dim, num_kv_heads * head_dim))
        self.qkv_proj = FusedLinear(hidden, ("q_proj", "k_proj", "v_proj"), (q_rows, kv_rows, kv_rows), bias,
                                    sources=sources)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias)
        self.q_norm = RMSNorm(head_dim, eps, zero_centered_norm)
        self.k_norm = RMSNorm(head_dim, eps, zero_centered_norm)
        self.scale = head_dim ** -0.5
        self.attn_index = -1  # index among the model's attention layers (set by the model)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def spec(self) -> AttentionLayerSpec:
        return AttentionLayerSpec(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)

    # The forward in three parts (runtime/prefill_graphs.py captures pre and post, row-wise, in
    # CUDA graphs at padded token counts and runs core, which reads the step's metadata, eagerly).
    def pre(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (self.qkv_proj(x),)

    def core(self, ctx: ForwardContext, pre: tuple[torch.Tensor, ...], rope: RotaryCache) -> torch.Tensor:
        qkv, = pre
        t = qkv.shape[0]
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        # q/k head norms and rotary in one op (one Triton kernel per q and k on CUDA)
        q, k, v = ops.qk_norm_rope(qkv, ctx.positions, self.q_norm.weight, self.k_norm.weight, rope.cos_sin_cache,
                                   hq, hk, d, rope.rotary_dim, self.q_norm.eps, self.q_norm.zero_centered,
                                   self.output_gate)
        o = paged_attention(ctx, q, k, v, self.k_cache, self.v_cache, self.scale)
        o = o.reshape(t, hq * d)
        if self.output_gate:
            gate = ops.split_qkv_heads(qkv, hq, hk, d, True)[3]
            o = o * torch.sigmoid(gate)
        return o

    def post(self, o: torch.Tensor) -> torch.Tensor:
        return self.o_proj(o)

    def output_projection(self) -> RowParallelLinear:
        return self.o_proj

    def core_width(self) -> int:
        """Features per token of core's output (what post reads)."""
        return self.num_heads * self.head_dim

    def forward(self, ctx: ForwardContext, x: torch.Tensor, rope: RotaryCache) -> torch.Tensor:
        return self.post(self.core(ctx, self.pre(x), rope))
