"""The per-step contract between the runtime and a model.

A model never imports the scheduler. It declares what per-sequence memory it needs
(`CacheSpec`), receives the allocated tensors once (`ModelCaches`, bound before the first
step and never reallocated, so CUDA graphs can capture them), and reads everything that
changes per step from one `ForwardContext` that the runtime fills.

Token layout of a step: the flattened tokens of all rows, decode rows first (exactly one
token each), then prefill rows (one or more new tokens each, possibly a chunk of a longer
prompt that continues a history already in the caches). `num_decode_tokens` splits the
two parts; ops for the decode part and the prefill part are called on the two slices.

Paged KV layout (per full-attention layer): k_cache, v_cache of shape
[num_pages, page_size, num_kv_heads, head_dim]. A sequence's pages are listed in
`kv_indices[kv_indptr[i]:kv_indptr[i+1]]`; its last page holds `kv_last_page_len[i]`
tokens (1..page_size). The KV of a step's new tokens is written first (slot_mapping:
flat slot = page * page_size + offset), so the kv lengths include the new tokens, and a
row's queries are the last `qo_len` positions of its kv sequence (causal).

Recurrent state (per Gated DeltaNet layer): conv state pool [num_slots, conv_dim, K-1]
(the last K-1 inputs, oldest first) and recurrent state pool [num_slots, Hv, Dk, Dv]
(MSTAR_GDN_STATE_DTYPE: bfloat16 for half-precision models, float32 for float32 ones, by default). Every row has one slot; a new sequence's slot is zeroed by the runtime. Snapshot
slots (for the prefix cache) come from the same pools.

Cross-attention K/V (encoder-decoder models, Whisper): per cross-attention layer, pools
cross_k_cache, cross_v_cache of shape [num_cross_slots, max_source_len, num_kv_heads,
head_dim]. Each running request owns one cross slot, filled once by `model.encode(...,
cross_slots=...)` when the request is admitted and read (never written) by every decoder
step; the runtime frees it with the request. A slot is laid out exactly like one KV page
of page_size = max_source_len, so decoder steps attend over it with the paged decode op
(one "row" per token: `CrossAttentionMetadata`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32: how dtypes travel between ranks and appear in logs and knobs."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class AttentionLayerSpec:
    """Paged K/V of one attention layer (and what a decode plan of it needs: query heads, scale)."""
    num_kv_heads: int
    head_dim: int
    num_q_heads: int = 0
    scale: float = 0.0


@dataclass(frozen=True)
class StateLayerSpec:
    conv_dim: int
    conv_kernel: int  # K; the pool keeps K-1 inputs
    num_heads: int  # value heads Hv
    key_dim: int
    value_dim: int


def cross_page_size(max_source_len: int) -> int:
    """Cross-attention reads a slot's K/V [max_source_len, H, D] as pages of this many positions:
    the largest divisor of max_source_len up to 64 (Whisper's 1500: 60, so 25 pages). FlashInfer's
    decode splits a row's keys across thread blocks only at page boundaries, so one 1500-position
    page gives a row's cross-attention one block per head. Measured on the H200 (large-v3, batch 1):
    the decode graph replay went 3721 -> 3512 us with pages of 60; most of the step was elsewhere
    (the LayerNorm's reference kernels, notes/gpu-2026-11-30-gate-knobs-whisper.md)."""
    return max(d for d in range(1, min(64, max_source_len) + 1) if max_source_len % d == 0)


def cross_slot_pages(slots, pages_per_slot: int, out: np.ndarray | None = None) -> np.ndarray:
    """The pages of each slot in the paged view, row after row: slot s holds pages
    s * pages_per_slot .. s * pages_per_slot + pages_per_slot - 1. [len(slots) * pages_per_slot] int32,
    written in place into `out` (a decode step's pinned staging buffer) when given."""
    s = np.asarray(slots, dtype=np.int32).reshape(-1, 1)
    if out is None:
        out = np.empty(s.shape[0] * pages_per_slot, dtype=np.int32)
    rows = out.reshape(-1, pages_per_slot)
    rows[...] = s
    rows *= pages_per_slot
    rows += np.arange(pages_per_slot, dtype=np.int32)
    return out


@dataclass(frozen=True)
class CrossAttentionSpec:
    """Encoder-decoder models: per request, the encoder output's K/V for every
    cross-attention layer (in decoder order), up to max_source_len positions. A slot's
    positions are read as `pages_per_slot` pages of `page_size` (cross_page_size)."""

    layers: tuple[AttentionLayerSpec, ...]
    max_source_len: int  # Whisper: 1500 encoder positions (30 s of audio)

    @property
    def page_size(self) -> int:
        return cross_page_size(self.max_source_len)

    @property
    def pages_per_slot(self) -> int:
        return self.max_source_len // self.page_size

    def bytes_per_sequence(self, dtype: torch.dtype) -> int:
        es = torch.empty((), dtype=dtype).element_size()
        return sum(2 * self.max_source_len * a.num_kv_heads * a.head_dim * es for a in self.layers)


@dataclass(frozen=True)
class CacheSpec:
    """What one sequence needs, per layer kind, in the order the model's layers use them."""

    attention: tuple[AttentionLayerSpec, ...] = ()
    state: tuple[StateLayerSpec, ...] = ()
    state_dtype: torch.dtype = torch.float32  # recurrent state dtype
    cross: CrossAttentionSpec | None = None  # encoder-decoder models: one cross slot per request

    @classmethod
    def from_specs(cls, specs, state_dtype: torch.dtype = torch.float32) -> "CacheSpec":
        """From a model's per-request memory as a list of typed specs, in layer order: paged K/V
        (AttentionLayerSpec), recurrent-state slots (StateLayerSpec) and at most one per-request
        slot of fixed-length K/V (CrossAttentionSpec: an encoder's output, filled on admission)."""
        specs = list(specs)
        cross = [s for s in specs if isinstance(s, CrossAttentionSpec)]
        if len(cross) > 1:
            raise ValueError("a model has at most one per-request slot spec")
        known = (AttentionLayerSpec, StateLayerSpec, CrossAttentionSpec)
        odd = [type(s).__name__ for s in specs if not isinstance(s, known)]
        if odd:
            raise ValueError(f"unknown memory specs: {odd}")
        return cls(attention=tuple(s for s in specs if isinstance(s, AttentionLayerSpec)),
                   state=tuple(s for s in specs if isinstance(s, StateLayerSpec)), state_dtype=state_dtype,
                   cross=cross[0] if cross else None)

    def specs(self) -> list:
        """The typed specs, as from_specs takes them."""
        return [*self.attention, *self.state, *([self.cross] if self.cross is not None else [])]

    def cross_bytes_per_sequence(self, dtype: torch.dtype) -> int:
        return self.cross.bytes_per_sequence(dtype) if self.cross is not None else 0

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        es = torch.empty((), dtype=dtype).element_size()
        return sum(2 * a.num_kv_heads * a.head_dim * es for a in self.attention)

    def state_bytes_per_sequence(self, conv_dtype: torch.dtype) -> int:
        ces = torch.empty((), dtype=conv_dtype).element_size()
        ses = torch.empty((), dtype=self.state_dtype).element_size()
        return sum(s.conv_dim * (s.conv_kernel - 1) * ces + s.num_heads * s.key_dim * s.value_dim * ses
                   for s in self.state)


@dataclass
class ModelCaches:
    """Tensors allocated by the runtime from a CacheSpec; bound to the model once."""

    k_caches: list[torch.Tensor] = field(default_factory=list)  # per attention layer
    v_caches: list[torch.Tensor] = field(default_factory=list)
    conv_states: list[torch.Tensor] = field(default_factory=list)  # per GDN layer
    recurrent_states: list[torch.Tensor] = field(default_factory=list)
    # when every GDN layer's state has one shape: [layers, rows, ...] tensors whose [i] are the
    # per-layer tensors above, so that a slot's rows in all layers are one strided view
    # (the runtime zeroes or copies a slot with one kernel per stack instead of one per layer)
    state_stacks: list[torch.Tensor] = field(default_factory=list)
    # per cross-attention layer: [num_cross_slots, max_source_len, Hkv, D] (CacheSpec.cross)
    cross_k_caches: list[torch.Tensor] = field(default_factory=list)
    cross_v_caches: list[torch.Tensor] = field(default_factory=list)


@dataclass
class AttentionMetadata:
    """Shared by every full-attention layer of a step. Index tensors are int32; the
    *_indptr arrays have one entry more than rows. kv_indices and slot_mapping live on the
    model's device; the *_indptr and *_last_page_len arrays may live on the host (CPU) when
    the model is on CUDA, so that attention backends plan from them without a device sync."""

    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes
    # decode rows (the first num_decode_tokens tokens, one per row)
    decode_kv_indptr: torch.Tensor
    decode_kv_indices: torch.Tensor
    decode_kv_last_page_len: torch.Tensor
    # prefill rows (the remaining tokens)
    prefill_qo_indptr: torch.Tensor  # relative to the first prefill token
    prefill_kv_indptr: torch.Tensor
    prefill_kv_indices: torch.Tensor
    prefill_kv_last_page_len: torch.Tensor


@dataclass
class StateMetadata:
    """Shared by every Gated DeltaNet layer of a step. int32 / int64 tensors on device."""

    decode_slots: torch.Tensor  # [num_decode] int64
    prefill_cu_seqlens: torch.Tensor  # [P + 1] int32, relative to the first prefill token
    prefill_slots: torch.Tensor  # [P] int64
    # Prefix-cache snapshots: after prefill token snap_token_idx[j] (index relative to the
    # first prefill token, inclusive) copy the state into slot snap_slots[j]. May be empty.
    snap_token_idx: torch.Tensor  # [S] int64
    snap_slots: torch.Tensor  # [S] int64


@dataclass
class CrossAttentionMetadata:
    """Shared by every cross-attention layer of a step: one row per token of the step
    (decode and prefill alike, in token order). Token t attends over its request's cross slot
    (every position, no causal mask), read by `paged_attention_decode` as pages of the slots'
    paged view [slots * pages_per_slot, page_size, H, D] (CrossAttentionSpec): slot s's page j
    is page s * pages_per_slot + j. int32; kv_indptr and kv_last_page_len may live on the host."""

    kv_indptr: torch.Tensor  # [T + 1] int32
    kv_indices: torch.Tensor  # the pages of each token's request's slot
    kv_last_page_len: torch.Tensor  # [T] int32: positions used on each token's last page

    @classmethod
    def for_rows(cls, slots, source_lens, tokens_per_row, *, page_size: int, pages_per_slot: int, device=None,
                 host_indptr: bool = False) -> "CrossAttentionMetadata":
        """From per-row lists (rows in the step's order: decode rows first, then prefill);
        source_lens[r]: positions of row r's slot it attends over (from 1 to a whole slot)."""
        idx, lens, last = [], [], []
        for slot, n, reps in zip(slots, source_lens, tokens_per_row):
            pages = -(-int(n) // page_size)
            if not 0 < pages <= pages_per_slot:
                raise ValueError(f"cross-attention over {n} positions: a slot holds 1..{page_size * pages_per_slot}")
            first = torch.from_numpy(cross_slot_pages([slot], pages_per_slot)[:pages])  # a partial slot: its first pages
            idx += [first] * int(reps)
            lens += [pages] * int(reps)
            last += [int(n) - (pages - 1) * page_size] * int(reps)
        indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        small_dev = torch.device("cpu") if host_indptr else dev
        indices = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int32)
        return cls(kv_indptr=indptr.to(small_dev), kv_indices=indices.to(dev),
                   kv_last_page_len=torch.tensor(last, dtype=torch.int32).to(small_dev))


@dataclass
class ForwardContext:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64: position of each token in its sequence
    num_decode_tokens: int
    attn: AttentionMetadata | None = None  # None when the model has no attention layers
    state: StateMetadata | None = None  # None when the model has no GDN layers
    # Rows of the hidden states to compute logits for (the last token of each row that
    # samples this step); the runtime passes them to model.compute_logits.
    logits_indices: torch.Tensor | None = None
    cross: CrossAttentionMetadata | None = None  # None unless the model has cross-attention

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
