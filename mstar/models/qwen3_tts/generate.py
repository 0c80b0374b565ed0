"""Batched frame generation for the Qwen3-TTS talker and code predictor, with continuous batching.

    gen = TalkerGenerator(lm.talker, lm.config, max_rows=64, num_pages=4096)
    state, first = gen.start(prompts, params, ids)    # prefill, then every row's first frame
    frame = gen.step(state)                           # every row's next frame
    more = gen.join(state, prompts, params, ids)      # new rows: prefilled, their first frame, appended
    gen.leave(state, rows)                            # rows removed (positions), their pages freed

A frame is 16 codes (codebook 0 from the talker, 1..15 from the code predictor). One step is one
talker decode for all rows, then the code predictor's G - 1 forwards for all rows, batched; the
only host sync is the read of the EOS flags. A row is done after a frame whose codebook 0 is the
codec EOS (that frame is not audio) or after its max_new_tokens-th frame; done rows must leave
before the next step.

Sampling is the release's: codebook 0 through a repetition penalty over the row's earlier codebook-0
tokens, the last 1024 codec ids suppressed except EOS, EOS blocked for the first min_new_tokens
frames, then temperature, top-k, top-p (or argmax when do_sample is off); codebooks 1..15 through
temperature, top-k, top-p (or argmax). Draws use mstar's counter-based noise (ops/sampling.py): row
r's draw of codebook j in frame k is a function of (seed_r, 16 k + j) and its logits only, so a
seeded row gives the same codes alone or in any batch. It is not the reference package's sampler,
whose torch.multinomial draws depend on the batch.

max_new_tokens counts frames: the reference package's generate(max_new_tokens=n) returns at most
n - 1 frames (the frame of its last codebook-0 token is never completed), so n + 1 there is n here.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from mstar.models.context import ForwardContext
from mstar.models.qwen3_tts.config import SUPPRESSED_TAIL, Qwen3TTSConfig
from mstar.models.qwen3_tts.frame_graphs import FixedSampler, FrameGraphs, site_plan
from mstar.models.qwen3_tts.prompt import TalkerPrompt
from mstar.models.qwen3_tts.talker import KVPool, PageTable, Talker
from mstar.models.shape_graphs import graph_mode


@dataclass(frozen=True)
class GenerationParams:
    """One request's sampling (the release's defaults; `from_generation_config` reads a
    checkpoint's generation_config.json). seed None: a random one."""
    do_sample: bool = True
    top_k: int = 50
    top_p: float = 1.0
    temperature: float = 0.9
    repetition_penalty: float = 1.05
    subtalker_dosample: bool = True
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    subtalker_temperature: float = 0.9
    max_new_tokens: int = 2048  # frames
    min_new_tokens: int = 2  # frames before EOS may be drawn
    seed: int | None = None

    @classmethod
    def from_generation_config(cls, gc: dict, **overrides) -> "GenerationParams":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{**{k: v for k, v in gc.items() if k in names}, **overrides})


def sampling_arrays(greedy: np.ndarray, temperature, top_k, top_p) -> list[np.ndarray]:
    """One sampling site's per-row (temperature, top_k, top_p, min_p) as the device holds them
    (greedy rows: temperature 0)."""
    t = np.where(greedy, 0.0, np.asarray(temperature, dtype=np.float32)).astype(np.float32)
    return [t, np.asarray(top_k, dtype=np.int64), np.asarray(top_p, dtype=np.float32), np.zeros_like(t)]


@dataclass
class Frame:
    """One frame of some rows: codes [B, G] int64 on the model's device; is_eos [B]: codebook 0 is
    the codec EOS (no audio); done [B]: the row has ended (EOS or its last frame); ids: the rows' keys."""
    codes: torch.Tensor
    is_eos: np.ndarray
    done: np.ndarray
    ids: list


@dataclass
class GenerationState:
    """A batch of rows (one request each), in order. Host: ids, params, frames (emitted so far),
    max_frames, done, pages (the talker K/V pages). Device: codes [B, G] (the last frame), frame_idx
    [B] (= frames), seen [B, V] (codebook-0 tokens drawn so far, for the repetition penalty), text
    [B, C, H] (trailing text embeddings, tts_pad from each row's end on), seeds [B]; the per-row
    sampling tensors; the samplers' plans."""
    ids: list
    params: list[GenerationParams]
    pages: PageTable
    frames: np.ndarray
    max_frames: np.ndarray
    done: np.ndarray
    codes: torch.Tensor
    frame_idx: torch.Tensor
    seen: torch.Tensor
    text: torch.Tensor
    seeds: torch.Tensor
    rep_penalty: torch.Tensor
    min_new: torch.Tensor
    talker_sampler: Any = None
    predictor_sampler: Any = None
    sampling_host: tuple = ()  # the two samplers' sampling_arrays
    version: int = 0  # bumped whenever the rows change (frame_graphs.py restages their constants)

    def __len__(self) -> int:
        return len(self.ids)


class TalkerGenerator:
    """The generation core over one Talker: the K/V pool (num_pages pages of page_size tokens), the
    code predictor's per-frame cache (max_rows rows), the token tables sampling needs.

    graphs: how a step runs its frame. "off": eagerly; "cuda": a CUDA graph per padded batch size
    (frame_graphs.py; CUDA only); "static": the graphs' buffers and padding, eagerly (tests);
    "auto": "cuda" on a CUDA device, else "off". The pool then keeps one more page, for the
    padding rows."""

    def __init__(self, talker: Talker, config: Qwen3TTSConfig, *, max_rows: int = 64, num_pages: int = 4096,
                 page_size: int = 16, graphs: str = "off"):
        self.talker, self.config, self.tc = talker, config, config.talker
        self.device = talker.codec_head.weight.device
        self.G = self.tc.num_code_groups
        graphs = graph_mode(graphs, self.device, "qwen3-tts")
        self.pool = KVPool(talker, num_pages + (graphs != "off"), page_size)
        self.pad_page = int(self.pool.take(1)[0]) if graphs != "off" else None
        talker.code_predictor.bind_cache(max_rows)
        self.max_rows = int(max_rows)
        V = self.tc.vocab_size
        self.suppress = torch.zeros(V, dtype=torch.bool, device=self.device)
        self.suppress[V - SUPPRESSED_TAIL:] = True
        self.suppress[self.tc.codec_eos_token_id] = False
        with torch.inference_mode():
            self.tts_pad = talker.text_embeds(torch.tensor([config.tts_pad_token_id], device=self.device))
            self.frame_graphs = FrameGraphs(self, graphs) if graphs != "off" else None

    # --- the public steps ---------------------------------------------------------------------
    @torch.inference_mode()
    def start(self, prompts: Sequence[TalkerPrompt], params: Sequence[GenerationParams] | GenerationParams | None = None,
              ids: Sequence | None = None) -> tuple[GenerationState, Frame]:
        """A new batch of these rows: (its state, every row's first frame)."""
        state = self._empty()
        return state, self.join(state, prompts, params, ids)

    @torch.inference_mode()
    def join(self, state: GenerationState, prompts: Sequence[TalkerPrompt],
             params: Sequence[GenerationParams] | GenerationParams | None = None, ids: Sequence | None = None) -> Frame:
        """Prefill new rows, draw their first frames and append them to `state` (after its rows)."""
        k = len(prompts)
        if isinstance(params, GenerationParams) or params is None:
            params = [params or GenerationParams()] * k
        ids = list(range(len(state.ids), len(state.ids) + k)) if ids is None else list(ids)
        if len(params) != k or len(ids) != k:
            raise ValueError(f"qwen3-tts: {k} prompts, {len(params)} params, {len(ids)} ids")
        if len(state) + k > self.max_rows:
            raise ValueError(f"qwen3-tts: {len(state) + k} rows, the generator holds {self.max_rows}")
        params = [p if p.seed is not None else dataclasses.replace(p, seed=random.getrandbits(63)) for p in params]
        dev = self.device
        new = self._rows(prompts, params)
        positions, md = state.pages.add_rows([len(p) for p in prompts])
        flat_text = torch.tensor([i for p in prompts for i in p.text_ids], device=dev)
        flat_codec = torch.tensor([i for p in prompts for i in p.codec_ids], device=dev)
        embeds = self.talker.prompt_embeds(flat_text, flat_codec)
        hidden = self.talker(ForwardContext(positions, positions, 0, attn=md), embeds)
        last = torch.tensor(np.cumsum([len(p) for p in prompts]) - 1, device=dev)
        hidden = hidden.index_select(0, last)
        codes = self._frame(new, hidden) if self.frame_graphs is None else self.frame_graphs.run_head(new, hidden)
        self._append(state, new, ids, params)
        return self._finish(state, codes, rows=slice(len(state) - k, None))

    @torch.inference_mode()
    def step(self, state: GenerationState) -> Frame:
        """Every row's next frame."""
        if state.done.any():
            raise ValueError(f"qwen3-tts: rows {np.nonzero(state.done)[0].tolist()} are done: leave() them first")
        B = len(state)
        col = (state.frame_idx - 1).clamp(max=state.text.shape[1] - 1)
        text = state.text[torch.arange(B, device=self.device), col]
        if self.frame_graphs is not None:
            return self._finish(state, self.frame_graphs.run(state, text), rows=slice(None))
        embeds = self.talker.frame_embeds(state.codes) + text
        positions, md = state.pages.advance()
        hidden = self.talker(ForwardContext(positions, positions, B, attn=md), embeds)
        return self._finish(state, self._frame(state, hidden), rows=slice(None))

    def leave(self, state: GenerationState, rows: Sequence[int]) -> None:
        """Remove rows (positions in the batch) and free their K/V pages; the others keep their order."""
        drop = set(int(r) for r in rows)
        keep = [i for i in range(len(state)) if i not in drop]
        state.pages.remove_rows(sorted(drop))
        state.ids = [state.ids[i] for i in keep]
        state.params = [state.params[i] for i in keep]
        for name in ("frames", "max_frames", "done"):
            setattr(state, name, getattr(state, name)[keep])
        idx = torch.tensor(keep, dtype=torch.int64, device=self.device)
        for name in ("codes", "frame_idx", "seen", "text", "seeds", "rep_penalty", "min_new"):
            setattr(state, name, getattr(state, name).index_select(0, idx))
        self._plan(state)

    # --- internals ----------------------------------------------------------------------------
    def _empty(self) -> GenerationState:
        dev, V, H = self.device, self.tc.vocab_size, self.tts_pad.shape[-1]
        z64 = torch.zeros(0, dtype=torch.int64, device=dev)
        return GenerationState(ids=[], params=[], pages=PageTable(self.pool), frames=np.zeros(0, np.int64),
                               max_frames=np.zeros(0, np.int64), done=np.zeros(0, bool),
                               codes=torch.zeros((0, self.G), dtype=torch.int64, device=dev), frame_idx=z64,
                               seen=torch.zeros((0, V), dtype=torch.bool, device=dev),
                               text=self.tts_pad.new_zeros((0, 1, H)), seeds=z64,
                               rep_penalty=torch.zeros(0, device=dev), min_new=z64)

    def _rows(self, prompts: Sequence[TalkerPrompt], params: Sequence[GenerationParams]) -> GenerationState:
        """The device part of a state for new rows (first frame not drawn yet)."""
        dev, k, V = self.device, len(prompts), self.tc.vocab_size
        lens = [len(p.trailing_ids) for p in prompts]
        cols = max(lens) + 1  # at least one tts_pad column: a row reads it from its text's end on
        text = self.tts_pad.expand(k, cols, -1).clone()
        if sum(lens):
            emb = self.talker.text_embeds(torch.tensor([i for p in prompts for i in p.trailing_ids], device=dev))
            mask = torch.arange(cols)[None, :] < torch.tensor(lens)[:, None]
            text[mask.to(dev)] = emb
        st = GenerationState(
            ids=[], params=list(params), pages=None, frames=np.zeros(k, np.int64), max_frames=np.zeros(k, np.int64),
            done=np.zeros(k, bool), codes=torch.zeros((k, self.G), dtype=torch.int64, device=dev),
            frame_idx=torch.zeros(k, dtype=torch.int64, device=dev),
            seen=torch.zeros((k, V), dtype=torch.bool, device=dev), text=text,
            seeds=torch.tensor([p.seed for p in params], dtype=torch.int64, device=dev),
            rep_penalty=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=dev),
            min_new=torch.tensor([p.min_new_tokens for p in params], dtype=torch.int64, device=dev))
        self._plan(st)
        return st

    def _plan(self, st: GenerationState) -> None:
        """The two samplers of the rows' parameters (host plan, device tensors)."""
        st.version += 1
        ps = st.params
        if not ps:
            st.talker_sampler = st.predictor_sampler = None
            st.sampling_host = ()
            return
        col = {f: np.asarray([getattr(p, f) for p in ps]) for f in GenerationParams.__dataclass_fields__
               if f != "seed"}
        st.sampling_host = (
            sampling_arrays(~col["do_sample"].astype(bool), col["temperature"], col["top_k"], col["top_p"]),
            sampling_arrays(~col["subtalker_dosample"].astype(bool), col["subtalker_temperature"],
                            col["subtalker_top_k"], col["subtalker_top_p"]))
        samplers = []
        for host, vocab in zip(st.sampling_host, (self.tc.vocab_size, self.tc.code_predictor_config.vocab_size)):
            samplers.append(FixedSampler(site_plan(host, vocab), [torch.from_numpy(a).to(self.device) for a in host]))
        st.talker_sampler, st.predictor_sampler = samplers

    def _append(self, state: GenerationState, new: GenerationState, ids: list, params: list) -> None:
        state.ids += ids
        state.params += params
        state.frames = np.concatenate([state.frames, new.frames])
        state.max_frames = np.concatenate([state.max_frames, [p.max_new_tokens for p in params]]).astype(np.int64)
        state.done = np.concatenate([state.done, new.done])
        cols = max(state.text.shape[1], new.text.shape[1])
        pad = [t if t.shape[1] == cols else torch.cat([t, self.tts_pad.expand(t.shape[0], cols - t.shape[1], -1)], 1)
               for t in (state.text, new.text)]
        state.text = torch.cat(pad)
        for name in ("codes", "frame_idx", "seen", "seeds", "rep_penalty", "min_new"):
            setattr(state, name, torch.cat([getattr(state, name), getattr(new, name)]))
        self._plan(state)

    def _frame(self, st: GenerationState, hidden: torch.Tensor) -> torch.Tensor:
        """The rows' new frame [B, G] from the talker's hidden states [B, H] (their last positions)."""
        eos = self.tc.codec_eos_token_id
        logits = self.talker.logits(hidden)
        rp = st.rep_penalty.unsqueeze(1)
        logits = torch.where(st.seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
        logits = logits.masked_fill(self.suppress, float("-inf"))
        logits[:, eos] = logits[:, eos].masked_fill(st.frame_idx < st.min_new, float("-inf"))
        step0 = st.frame_idx * self.G
        code0 = st.talker_sampler(logits, st.seeds, step0)
        st.seen.scatter_(1, code0.unsqueeze(1), True)

        def sample(lg: torch.Tensor, j: int) -> torch.Tensor:
            return st.predictor_sampler(lg, st.seeds, step0 + j)

        cp = self.talker.code_predictor
        return cp.generate(hidden, code0, self.talker.model.codec_embedding(code0), sample)

    def _finish(self, state: GenerationState, codes: torch.Tensor, rows: slice) -> Frame:
        state.codes[rows] = codes
        state.frame_idx[rows] += 1
        state.frames[rows] += 1
        is_eos = (codes[:, 0] == self.tc.codec_eos_token_id).cpu().numpy()  # the step's one host sync
        done = is_eos | (state.frames[rows] >= state.max_frames[rows])
        state.done[rows] = done
        return Frame(codes, is_eos, done, state.ids[rows])
