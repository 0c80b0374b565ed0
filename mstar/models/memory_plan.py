"""Per-rank memory plan of a model under tensor parallelism, from shapes on the meta device
(nothing full-size is allocated): weight bytes per rank, KV bytes per token and state bytes
per sequence per rank, and how many sequences of a given length fit in a GPU's memory once
the weights are loaded, sized the way the engine sizes its caches.

Each rank's shapes come from the model itself, built on meta inside
`parallel.building(rank, size)` (the layers size their shards at construction; no process
group is needed until a forward), so the sharding arithmetic is parallel.py's and the
layers', not re-derived here.

Cache sizing mirrors `mstar.runtime.engine.config.size_caches` for a decoder model on CUDA with
`num_pages` left to the engine: the budget is `CACHE_FRACTION` of the free memory after the
model is loaded (the smallest over the ranks), minus one state slot per running sequence,
minus the prefix cache's state snapshots (a quarter of what is left, at most 4 per running
sequence, at least min(8, 4 x sequences)); the KV pages get the rest (one page more than the
sequences need: the engine allocates `num_slots * pages_per_seq + 1`). Models never import
the runtime, so the fraction is repeated here; tests/test_memory_plan.py checks it and the
sizing against the runtime's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mstar.models import parallel
from mstar.models.context import dtype_name

CACHE_FRACTION = 0.85  # of free device memory given to caches; the engine uses this value
GIB = 1 << 30


def human_bytes(n: int) -> str:
    if n >= 1 << 30:
        return f"{n:,} B ({n / (1 << 30):.2f} GiB)"
    if n >= 1 << 20:
        return f"{n:,} B ({n / (1 << 20):.2f} MiB)"
    if n >= 1 << 10:
        return f"{n:,} B ({n / (1 << 10):.2f} KiB)"
    return f"{n:,} B"


def _es(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def rank_model(config, rank: int, size: int, dtype: torch.dtype = torch.bfloat16):
    """Rank `rank` of `size`'s model on the meta device (its shards' shapes, no storage)."""
    from mstar.models.loader import build_model
    parallel.check_config(config, size)
    with parallel.building(rank, size):
        return build_model(config, dtype=dtype, device="meta")


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds, in bytes of `dtype` (the fp32 buffers and state in their own)."""

    rank: int
    size: int
    weight_bytes: int  # every parameter of the rank (a tied head counted once)
    replicated_bytes: int  # unsharded tensors, whole on every rank (norms)
    replicated_kv_bytes: int  # k/v projection rows of a KV head that size // num_kv_heads ranks share
    padding_bytes: int  # vocabulary padding rows (embedding / head), zero
    buffer_bytes: int  # non-weight buffers (the fp32 rope table), whole on every rank
    kv_bytes_per_token: int
    state_bytes_per_sequence: int  # recurrent state in `state_dtype` + conv state in `dtype`
    num_attention_layers: int
    num_state_layers: int
    replicated_names: tuple[str, ...] = ()  # distinct kinds of replicated tensors (name without layer index)
    state_dtype: str = "float32"  # the recurrent state's (MSTAR_GDN_STATE_DTYPE)

    @property
    def resident_bytes(self) -> int:
        return self.weight_bytes + self.buffer_bytes


def rank_memory(config, rank: int, size: int, dtype: torch.dtype = torch.bfloat16) -> RankMemory:
    model = rank_model(config, rank, size, dtype)
    es = _es(dtype)
    kv_heads = int(getattr(config, "num_key_value_heads", 0) or 0)
    kv_shared = size > 1 and kv_heads and size > kv_heads
    repl = repl_kv = pad = 0
    names: dict[str, None] = {}
    for name, slot in model.expected_weights().items():
        t = slot.target()
        n = math.prod(t.shape) * es
        sh = slot.shard
        if sh is None:
            if size > 1:
                repl += n
                short = ".".join(p for p in name.split(".") if not p.isdigit())
                names[short.removeprefix("model.layers.").removesuffix(".weight")] = None
        elif kv_shared and name.rsplit(".", 1)[0].endswith(("k_proj", "v_proj")):
            repl_kv += n
        if sh is not None and sh.pad_from is not None and sh.pad_from < t.shape[0]:
            pad += (t.shape[0] - sh.pad_from) * math.prod(t.shape[1:]) * es
    spec = model.cache_spec()
    return RankMemory(
        rank=rank, size=size,
        weight_bytes=sum(math.prod(p.shape) for p in model.parameters()) * es,
        replicated_bytes=repl, replicated_kv_bytes=repl_kv, padding_bytes=pad,
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        kv_bytes_per_token=spec.kv_bytes_per_token(dtype),
        state_bytes_per_sequence=spec.state_bytes_per_sequence(dtype),
        num_attention_layers=len(spec.attention), num_state_layers=len(spec.state),
        replicated_names=tuple(names), state_dtype=dtype_name(spec.state_dtype))


# --- cache sizing (runtime.config.size_caches, CUDA, num_pages from memory) -------------------------
@dataclass(frozen=True)
class CacheUse:
    num_seqs: int
    pages_per_seq: int
    num_pages: int  # what the engine wants: num_seqs * pages_per_seq + 1
    state_bytes: int  # one state slot per sequence
    snapshot_slots: int
    snapshot_bytes: int
    kv_bytes: int  # num_pages pages
    left_bytes: int  # budget minus all of the above (< 0: does not fit)

    @property
    def fits(self) -> bool:
        return self.left_bytes >= 0


def default_snapshot_slots(num_seqs: int, budget_left: int, state_bytes: int) -> int:
    """The prefix cache's state snapshot slots (hybrid models): a quarter of the budget left
    after the running sequences' states, at most 4 per running sequence, at least min(8, 4n).
    The engine sizes its pools with this too (mstar.runtime.engine.config.size_caches)."""
    snap = int(min(4 * num_seqs, max(budget_left, 0) // 4 // max(state_bytes, 1)))
    return max(snap, min(8, 4 * num_seqs))


def cache_use(budget: int, num_seqs: int, context: int, page_size: int, kv_bytes_per_token: int,
              state_bytes_per_sequence: int, prefix_caching: bool = True) -> CacheUse:
    """The caches the engine allocates for `num_seqs` running sequences of `context` tokens."""
    pps = math.ceil(context / page_size)
    page_bytes = max(1, kv_bytes_per_token * page_size)
    s = state_bytes_per_sequence
    rest = budget - num_seqs * s
    snap = default_snapshot_slots(num_seqs, rest, s) if s > 0 and prefix_caching else 0
    rest -= snap * s
    num_pages = num_seqs * pps + 1 if kv_bytes_per_token > 0 else 0
    kv = num_pages * page_bytes if kv_bytes_per_token > 0 else 0
    return CacheUse(num_seqs, pps, num_pages, num_seqs * s, snap, snap * s, kv, rest - kv)


def max_sequences(budget: int, context: int, page_size: int, kv_bytes_per_token: int,
                  state_bytes_per_sequence: int, prefix_caching: bool = True) -> int:
    """The most sequences of `context` tokens whose caches fit in `budget` (0 if none)."""
    def fits(n):
        return cache_use(budget, n, context, page_size, kv_bytes_per_token, state_bytes_per_sequence,
                         prefix_caching).fits
    per = state_bytes_per_sequence + math.ceil(context / page_size) * page_size * kv_bytes_per_token
    lo, hi = 0, max(budget, 0) // max(per, 1) + 1  # fits(hi) is False
    if not fits(1):
        return 0
    lo = 1
    while hi - lo > 1:  # the use grows with the number of sequences
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# --- the plan ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryPlan:
    name: str
    tp: int
    dtype: torch.dtype
    full_weight_bytes: int  # the unsharded model's parameters
    ranks: tuple[RankMemory, ...]
    gpu_mem_bytes: int
    reserve_bytes: int  # per GPU, not available to the engine (CUDA context, NCCL buffers)
    cache_fraction: float
    context: int
    max_num_seqs: int
    page_size: int
    prefix_caching: bool
    budget_bytes: int  # cache memory per rank
    max_seqs: int  # sequences of `context` tokens that fit
    at_max_num_seqs: CacheUse

    @property
    def rank0(self) -> RankMemory:
        return self.ranks[0]

    @property
    def fits(self) -> bool:
        return self.at_max_num_seqs.fits

    def lines(self) -> list[str]:
        r, u, g = self.rank0, self.at_max_num_seqs, GIB
        held = sum(x.weight_bytes for x in self.ranks)
        dup = held - self.full_weight_bytes
        repl = ", ".join(r.replicated_names) or "none"
        dt = str(self.dtype).removeprefix("torch.")
        alike = "every rank alike" if len({(x.weight_bytes, x.kv_bytes_per_token, x.state_bytes_per_sequence)
                                           for x in self.ranks}) == 1 else "rank 0 shown; largest rank used"
        out = [
            f"memory plan, tp {self.tp} ({dt} weights; per rank = per GPU; {alike}):",
            f"  weights per rank: {human_bytes(r.weight_bytes)}; the full model {human_bytes(self.full_weight_bytes)}"
            f" ({self.full_weight_bytes / 1e9:.2f} GB)",
            f"    replicated on every rank: {human_bytes(r.replicated_bytes)}: {repl}; "
            f"shared KV-head copies: {human_bytes(r.replicated_kv_bytes)}; vocab padding: "
            f"{human_bytes(r.padding_bytes)}; over all ranks {human_bytes(held)} = full + {dup:,} B duplicated",
            f"  buffers per rank (fp32 rope table): {human_bytes(r.buffer_bytes)}",
            f"  KV cache per token per rank: {human_bytes(r.kv_bytes_per_token)} over {r.num_attention_layers} "
            f"attention layers",
            f"  state per sequence per rank ({'fp32' if r.state_dtype == 'float32' else r.state_dtype} recurrent, "
            f"{dt} conv): "
            f"{human_bytes(r.state_bytes_per_sequence)} over {r.num_state_layers} Gated DeltaNet layers",
            f"  cache budget per rank: ({self.gpu_mem_bytes / g:.2f} GiB GPU - {r.resident_bytes / g:.2f} GiB "
            f"weights+buffers - {self.reserve_bytes / g:.2f} GiB reserve) x {self.cache_fraction} = "
            f"{human_bytes(self.budget_bytes)}",
            f"  sequences of {self.context} tokens ({u.pages_per_seq} pages of {self.page_size}) that fit: "
            f"{self.max_seqs:,} (prefix caching {'on' if self.prefix_caching else 'off'})",
            f"  max-num-seqs {self.max_num_seqs} x {self.context} tokens: "
            f"{'fits' if self.fits else 'DOES NOT FIT'}: states {u.state_bytes / g:.2f} GiB + "
            f"{u.snapshot_slots} snapshot slots {u.snapshot_bytes / g:.2f} GiB + {u.num_pages:,} KV pages "
            f"{u.kv_bytes / g:.2f} GiB; {u.left_bytes / g:.2f} GiB of the budget left",
        ]
        return out


def plan(name_or_dir: str, tp: int = 1, *, gpu_mem_gib: float = 139.0, max_num_seqs: int = 128,
         context: int = 512, page_size: int | None = None, cache_fraction: float = CACHE_FRACTION,
         reserve_gib: float = 0.0, prefix_caching: bool = True,
         dtype: torch.dtype = torch.bfloat16, config=None) -> MemoryPlan:
    """The memory plan of `name_or_dir` at tensor-parallel size `tp` on GPUs of `gpu_mem_gib`."""
    from mstar.models.loader import resolve_config
    if config is None:
        config = resolve_config(name_or_dir)
    if getattr(config, "model_type", "") == "whisper":
        raise ValueError("memory plan: decoder language models only (Qwen3.5 / Qwen3)")
    if page_size is None:
        from mstar import knobs
        page_size = int(knobs.value("MSTAR_PAGE_SIZE"))
    if tp < 1 or max_num_seqs < 1 or context < 1 or page_size < 1:
        raise ValueError("memory plan: tp, max_num_seqs, context and page_size must be positive")
    full = rank_model(config, 0, 1, dtype)
    full_bytes = sum(math.prod(p.shape) for p in full.parameters()) * _es(dtype)
    ranks = tuple(rank_memory(config, r, tp, dtype) for r in range(tp))
    gpu = int(gpu_mem_gib * GIB)
    reserve = int(reserve_gib * GIB)
    resident = max(x.resident_bytes for x in ranks)
    budget = int(max(gpu - reserve - resident, 0) * cache_fraction)
    kv = max(x.kv_bytes_per_token for x in ranks)
    st = max(x.state_bytes_per_sequence for x in ranks)
    return MemoryPlan(
        name=name_or_dir, tp=tp, dtype=dtype, full_weight_bytes=full_bytes, ranks=ranks,
        gpu_mem_bytes=gpu, reserve_bytes=reserve, cache_fraction=cache_fraction, context=context,
        max_num_seqs=max_num_seqs, page_size=page_size, prefix_caching=prefix_caching, budget_bytes=budget,
        max_seqs=max_sequences(budget, context, page_size, kv, st, prefix_caching),
        at_max_num_seqs=cache_use(budget, max_num_seqs, context, page_size, kv, st, prefix_caching))
