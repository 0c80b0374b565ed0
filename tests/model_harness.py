"""Test-only driver for an mstar model: allocates caches for its CacheSpec, builds the
ForwardContext of each step and returns logits. Not the runtime: no scheduler, no prefix
cache; each sequence owns a fixed run of pages (randomly permuted across the pool, to
catch indexing bugs) and one state slot (also permuted).

    h = Harness(model, max_seqs=4, max_len=128, page_size=4)
    out = h.step(prefill={0: [1, 2, 3], 1: [4, 5]})       # {seq: logits [n, vocab]}
    out = h.step(decode={0: 7, 1: 9}, prefill={2: [..]})  # decode rows first, then prefill
"""

from __future__ import annotations

import math

import torch

from mstar.models.context import AttentionMetadata, ForwardContext, ModelCaches, StateMetadata


class Harness:
    def __init__(self, model, *, max_seqs: int = 4, max_len: int = 128, page_size: int = 4, seed: int = 0,
                 kv_dtype: torch.dtype | None = None):
        self.model = model
        self.page_size = page_size
        dev, dt = model.device, model.dtype
        self.device = dev
        spec = model.cache_spec()
        self.spec = spec
        gen = torch.Generator().manual_seed(seed)
        pages_per_seq = math.ceil(max_len / page_size)
        num_pages = max_seqs * pages_per_seq + 3  # a few pages nobody owns
        perm = torch.randperm(num_pages, generator=gen).tolist()
        self.pages = {s: perm[s * pages_per_seq:(s + 1) * pages_per_seq] for s in range(max_seqs)}
        num_slots = max_seqs + 2
        slot_perm = torch.randperm(num_slots, generator=gen).tolist()
        self.slots = {s: slot_perm[s] for s in range(max_seqs)}
        kvd = kv_dtype or dt
        self.caches = ModelCaches(
            k_caches=[torch.randn(num_pages, page_size, a.num_kv_heads, a.head_dim, generator=gen).to(dev, kvd)
                      for a in spec.attention],
            v_caches=[torch.randn(num_pages, page_size, a.num_kv_heads, a.head_dim, generator=gen).to(dev, kvd)
                      for a in spec.attention],
            # garbage everywhere: a new sequence's slot is zeroed when it starts (as the runtime does)
            conv_states=[torch.randn(num_slots, s.conv_dim, s.conv_kernel - 1, generator=gen).to(dev, dt)
                         for s in spec.state],
            recurrent_states=[torch.randn(num_slots, s.num_heads, s.key_dim, s.value_dim,
                                          generator=gen).to(dev, spec.state_dtype) for s in spec.state],
        )
        model.bind_caches(self.caches)
        self.lens: dict[int, int] = {}

    # --- metadata -----------------------------------------------------------------------------
    def _kv_rows(self, seqs: list[int], new: list[int]):
        indptr, indices, last = [0], [], []
        for s, n in zip(seqs, new):
            kv_len = self.lens.get(s, 0) + n
            npages = math.ceil(kv_len / self.page_size)
            indices += self.pages[s][:npages]
            indptr.append(len(indices))
            last.append(kv_len - (npages - 1) * self.page_size)
        i32 = dict(dtype=torch.int32, device=self.device)
        return torch.tensor(indptr, **i32), torch.tensor(indices, **i32), torch.tensor(last, **i32)

    def _reset_state(self, s: int) -> None:
        slot = self.slots[s]
        for c in self.caches.conv_states:
            c[slot].zero_()
        for r in self.caches.recurrent_states:
            r[slot].zero_()

    def spare_slots(self) -> list[int]:
        """State slots no sequence owns (for prefix-cache snapshots)."""
        used = set(self.slots.values())
        return [i for i in range(self.caches.recurrent_states[0].shape[0]) if i not in used] \
            if self.caches.recurrent_states else []

    def _flat_slot(self, s: int, p: int) -> int:
        return self.pages[s][p // self.page_size] * self.page_size + p % self.page_size

    def fork(self, dst: int, src: int, n: int, snap_slot: int | None) -> None:
        """Start sequence dst as a copy of src's first n tokens (as a prefix cache would):
        their KV, and the recurrent state snapshotted after token n - 1 into snap_slot."""
        idx_src = torch.tensor([self._flat_slot(src, p) for p in range(n)], device=self.device)
        idx_dst = torch.tensor([self._flat_slot(dst, p) for p in range(n)], device=self.device)
        for c in self.caches.k_caches + self.caches.v_caches:
            flat = c.view(-1, *c.shape[2:])
            flat[idx_dst] = flat[idx_src]
        for pool in self.caches.conv_states + self.caches.recurrent_states:
            pool[self.slots[dst]] = pool[snap_slot]
        self.lens[dst] = n

    def build_context(self, decode: dict[int, int], prefill: dict[int, list[int]],
                      snapshots: dict[int, list[tuple[int, int]]] | None = None) -> ForwardContext:
        """snapshots: {prefill seq: [(index among its new tokens, state slot)]}."""
        dseqs, pseqs = list(decode), list(prefill)
        for s in pseqs:
            if self.lens.get(s, 0) == 0:
                self._reset_state(s)
        ids, pos, slot_map = [], [], []
        rows = [(s, [decode[s]]) for s in dseqs] + [(s, list(prefill[s])) for s in pseqs]
        for s, toks in rows:
            start = self.lens.get(s, 0)
            for j, t in enumerate(toks):
                p = start + j
                ids.append(t)
                pos.append(p)
                slot_map.append(self._flat_slot(s, p))
        dev = self.device
        i64 = dict(dtype=torch.int64, device=dev)
        d_ind = self._kv_rows(dseqs, [1] * len(dseqs))
        p_ind = self._kv_rows(pseqs, [len(prefill[s]) for s in pseqs])
        qo = [0]
        for s in pseqs:
            qo.append(qo[-1] + len(prefill[s]))
        qo_t = torch.tensor(qo, dtype=torch.int32, device=dev)
        snap_idx, snap_slots = [], []
        for s, q0 in zip(pseqs, qo):
            for j, slot in (snapshots or {}).get(s, []):
                assert 0 <= j < len(prefill[s])
                snap_idx.append(q0 + j)
                snap_slots.append(slot)
        spec = self.spec
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slot_map, **i64),
            decode_kv_indptr=d_ind[0], decode_kv_indices=d_ind[1], decode_kv_last_page_len=d_ind[2],
            prefill_qo_indptr=qo_t, prefill_kv_indptr=p_ind[0], prefill_kv_indices=p_ind[1],
            prefill_kv_last_page_len=p_ind[2]) if spec.attention else None
        state = StateMetadata(
            decode_slots=torch.tensor([self.slots[s] for s in dseqs], **i64),
            prefill_cu_seqlens=qo_t.clone(),
            prefill_slots=torch.tensor([self.slots[s] for s in pseqs], **i64),
            snap_token_idx=torch.tensor(snap_idx, **i64), snap_slots=torch.tensor(snap_slots, **i64)) \
            if spec.state else None
        return ForwardContext(input_ids=torch.tensor(ids, **i64), positions=torch.tensor(pos, **i64),
                              num_decode_tokens=len(dseqs), attn=attn, state=state)

    # --- stepping -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, decode: dict[int, int] | None = None, prefill: dict[int, list[int]] | None = None,
             snapshots: dict[int, list[tuple[int, int]]] | None = None) -> dict[int, torch.Tensor]:
        """Run one step; returns {seq: float32 logits of every new token [n, vocab]}."""
        decode, prefill = decode or {}, prefill or {}
        assert not set(decode) & set(prefill)
        ctx = self.build_context(decode, prefill, snapshots)
        hidden = self.model(ctx)
        logits = self.model.compute_logits(hidden)
        out, t = {}, 0
        for s in decode:
            out[s] = logits[t:t + 1]
            t += 1
            self.lens[s] = self.lens.get(s, 0) + 1
        for s, toks in prefill.items():
            out[s] = logits[t:t + len(toks)]
            t += len(toks)
            self.lens[s] = self.lens.get(s, 0) + len(toks)
        return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (b the reference)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
