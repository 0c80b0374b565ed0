"""The Qwen3-TTS frame as one CUDA graph per padded batch size.

A frame is one talker decode, the codebook-0 sampling and the code predictor's 15 forwards and
samplings: ~1,000 small kernels whose launches cost far more host time than the GPU spends on
them. `FrameGraphs` captures the whole frame over fixed buffers, once per (batch size, sampling
plans), and a step replays it:

  1. the host advances the rows' talker pages (padded to the captured size b), copies the step's
     positions, KV slots, the previous frame's codes, the text embeddings and the rows' penalty
     state into the buffers, and refreshes the talker's decode plan outside the graph
     (ops.decode_graph_plan); the rows' sampling parameters are copied only when rows join or leave;
  2. the graph replays; the first B rows of its output are the frame's codes, and the updated
     repetition-penalty flags are copied back to the rows' state.

New rows' first frame (after their prefill, which runs eagerly: its layout is the prompts') is
the frame's head alone, sampling and code predictor from the prefill's last hidden states: a
second graph per padded size ("head"), over the same buffers.

Padding rows (b - B of them) decode at position 0 over a page of the pool kept for them, with
row 0's sampling parameters (so a batch of one kind of request keeps one plan); their outputs
are dropped. A step whose sampling plan indexes a subset of rows (mixed parameters that need
the full-vocabulary stages) runs the same buffers eagerly.

Mode "static" runs every step eagerly over the buffers and padding, never capturing: how the CPU
tests check the graph's inputs against the plain step, code for code.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mstar import ops
from mstar.models.context import AttentionMetadata, ForwardContext
from mstar.models.shape_graphs import capture_after_first_use, padded_batch, padded_sizes
from mstar.ops import sampling

log = logging.getLogger("mstar.models")


@dataclass
class FrameInputs:
    """What the frame reads besides the talker's hidden states (generate.TalkerGenerator._frame):
    per-row penalty state and sampling, as views of the fixed buffers."""
    seen: torch.Tensor
    rep_penalty: torch.Tensor
    frame_idx: torch.Tensor
    min_new: torch.Tensor
    seeds: torch.Tensor
    talker_sampler: Any
    predictor_sampler: Any


_SAMPLING = ("temperature", "top_k", "top_p", "min_p")


class FrameGraphs:
    """The frame of a TalkerGenerator (`gen`) over fixed buffers of up to gen.max_rows rows.
    mode "cuda": captured and replayed; "static": the same buffers, run eagerly."""

    def __init__(self, gen, mode: str = "cuda"):
        if mode not in ("cuda", "static"):
            raise ValueError(f"frame graphs: mode {mode!r} (cuda | static)")
        self.gen, self.mode = gen, mode
        talker, dev, b_max = gen.talker, gen.device, gen.max_rows
        self.sizes = padded_sizes(b_max)
        tc = gen.tc
        i64 = dict(dtype=torch.int64, device=dev)
        self.codes_in = torch.zeros((b_max, gen.G), **i64)
        self.text = torch.zeros((b_max, tc.hidden_size), dtype=gen.tts_pad.dtype, device=dev)
        self.hidden = torch.zeros((b_max, tc.hidden_size), dtype=gen.tts_pad.dtype, device=dev)
        self.positions = torch.zeros(b_max, **i64)
        self.slots = torch.zeros(b_max, **i64)
        self.seen = torch.zeros((b_max, tc.vocab_size), dtype=torch.bool, device=dev)
        self.frame_idx = torch.zeros(b_max, **i64)
        self.min_new = torch.zeros(b_max, **i64)
        self.seeds = torch.zeros(b_max, **i64)
        self.rep_penalty = torch.ones(b_max, dtype=torch.float32, device=dev)
        # the two samplers' per-row parameters, in make_plan's order
        self.sampling = [[torch.zeros(b_max, dtype=torch.float32 if n != "top_k" else torch.int64, device=dev)
                          for n in _SAMPLING] for _ in range(2)]
        spec = talker.attention_layers[0].spec()
        pool = gen.pool
        self.plans: dict[int, ops.StaticDecodePlan] = {}
        self.contexts: dict[int, ForwardContext] = {}
        empty32 = torch.zeros(0, dtype=torch.int32)
        zero1 = torch.zeros(1, dtype=torch.int32)
        for b in self.sizes:
            plan = self.plans[b] = ops.decode_graph_plan(
                dev, batch=b, max_pages=pool.num_pages + b, num_q_heads=spec.num_q_heads,
                num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, page_size=pool.page_size,
                dtype=gen.tts_pad.dtype, scale=spec.scale)
            md = AttentionMetadata(slot_mapping=self.slots[:b], decode_kv_indptr=plan.indptr,
                                   decode_kv_indices=plan.indices, decode_kv_last_page_len=plan.last_page_len,
                                   prefill_qo_indptr=zero1, prefill_kv_indptr=zero1,
                                   prefill_kv_indices=empty32.to(dev), prefill_kv_last_page_len=empty32)
            self.contexts[b] = ForwardContext(self.positions[:b], self.positions[:b], b, attn=md)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.stream = None
        self.capture_s = 0.0
        self._staged = None  # (state, its version, b) whose row constants are in the buffers
        self._inputs: FrameInputs | None = None
        self._key: tuple | None = None

    def bucket(self, rows: int) -> int:
        return padded_batch(rows, self.sizes[-1])

    # --- a step ---------------------------------------------------------------------------------
    def run(self, state, text: torch.Tensor) -> torch.Tensor:
        """The rows' new frame [B, G] (a fresh tensor); `text` [B, H]: this step's text embeddings.
        Advances the rows' pages and updates state.seen, as the eager step does."""
        B = len(state)
        b = self._stage(state, B)
        self.codes_in[:B].copy_(state.codes)
        self.text[:B].copy_(text)
        positions, md = state.pages.advance(pad_to=b, pad_page=self.gen.pad_page)
        self.positions[:b].copy_(positions)
        self.slots[:b].copy_(md.slot_mapping)
        self.plans[b].plan(md.decode_kv_indptr, md.decode_kv_indices, md.decode_kv_last_page_len)
        return self._replay(state, B, b, "frame", self._forward)

    def run_head(self, state, hidden: torch.Tensor) -> torch.Tensor:
        """The frame's sampling and code predictor alone, from the talker's hidden states [B, H]
        (new rows after their prefill: `state` holds their device part, its ids not yet set):
        their first frame [B, G]; updates state.seen."""
        B = hidden.shape[0]
        b = self._stage(state, B)
        self.hidden[:B].copy_(hidden)
        return self._replay(state, B, b, "head", self._head)

    def _stage(self, state, B: int) -> int:
        """The rows' constants (when they changed) and penalty state into the buffers: the padded size."""
        b = self.bucket(B)
        staged = self._staged
        if staged is None or staged[0] is not state or staged[1:] != (state.version, b):
            self._stage_rows(state, B, b)
        self.seen[:B].copy_(state.seen)
        self.frame_idx[:B].copy_(state.frame_idx)
        return b

    def _replay(self, state, B: int, b: int, kind: str, fn) -> torch.Tensor:
        if self.mode == "static" or self._key is None:
            out = fn(b)
        else:
            got = self.graphs.get((kind,) + self._key)
            if got is None:
                got = self._capture(b, kind, fn)
                self.seen[:B].copy_(state.seen)  # the capture's warm-up run marked this frame's codes
            got[0].replay()
            out = got[1]
        state.seen.copy_(self.seen[:B])
        return out[:B].clone()

    def _stage_rows(self, state, B: int, b: int) -> None:
        """The rows' per-request constants (seeds, penalties, sampling) into the buffers, padded
        with row 0's; the samplers' plans of the padded batch; the graph key."""
        self.seeds[:B].copy_(state.seeds)
        self.rep_penalty[:B].copy_(state.rep_penalty)
        self.min_new[:B].copy_(state.min_new)
        if b > B:
            for t in (self.seeds, self.rep_penalty, self.min_new):
                t[B:b].copy_(t[:1].expand(b - B))
        samplers = []
        for bufs, host, vocab in zip(self.sampling, state.sampling_host,
                                     (self.gen.tc.vocab_size, self.gen.tc.code_predictor_config.vocab_size)):
            padded = [np.concatenate([a, np.repeat(a[:1], b - B)]) for a in host]
            for buf, a in zip(bufs, padded):
                buf[:b].copy_(torch.from_numpy(a))
            samplers.append(FixedSampler(site_plan(padded, vocab), [buf[:b] for buf in bufs]))
        self._inputs = FrameInputs(self.seen[:b], self.rep_penalty[:b], self.frame_idx[:b], self.min_new[:b],
                                   self.seeds[:b], *samplers)
        plans = (samplers[0].plan, samplers[1].plan)
        # a plan that indexes some rows copies their indices from the host: not in a graph
        whole = all(len(r) in (0, b) for p in plans for r in (p.full_rows, p.ref_rows))
        self._key = (b, plans) if whole else None
        self._staged = (state, state.version, b)

    def _forward(self, b: int) -> torch.Tensor:
        gen = self.gen
        embeds = gen.talker.frame_embeds(self.codes_in[:b]) + self.text[:b]
        hidden = gen.talker(self.contexts[b], embeds)
        return gen._frame(self._inputs, hidden)

    def _head(self, b: int) -> torch.Tensor:
        return self.gen._frame(self._inputs, self.hidden[:b])

    def _capture(self, b: int, kind: str, fn) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """One eager run on the capture stream (lazy inits, autotuning), then the capture."""
        t0 = time.perf_counter()
        dev = self.gen.device
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(dev)
        got = self.graphs[(kind,) + self._key] = capture_after_first_use(lambda: fn(b), self.stream, self.pool)
        dt = time.perf_counter() - t0
        self.capture_s += dt
        log.info("qwen3-tts %s graph: %d rows captured in %.2f s (%d graphs)", kind, b, dt, len(self.graphs))
        return got


def site_plan(arrays: list, vocab: int) -> sampling.SamplePlan:
    """The plan of one sampling site's per-row (temperature, top_k, top_p, min_p) arrays. Its
    candidates are the whole vocabulary: every row is decided in one pass (no redo, no host sync)."""
    return sampling.make_plan(*arrays, vocab, candidates=vocab)


class FixedSampler:
    """sample_planned over parameter buffers (the graph reads them where they lie)."""

    def __init__(self, plan: sampling.SamplePlan, args: list[torch.Tensor]):
        self.plan, self.args = plan, args

    def __call__(self, logits: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        return sampling.sample_planned(logits, *self.args, seeds, steps, 0, self.plan, token_logprobs=False)[0]
