"""Streaming decode of the Qwen3-TTS codec over many streams at once.

A stream is one utterance's codes arriving a few frames at a time. Its decoder state is the
history of every causal layer (Qwen3TTSCodecDecoder.history_shapes: each conv's last inputs, each
attention layer's last sliding_window - 1 keys and values) and the number of frames it decoded;
with that state, decoding a stream chunk by chunk gives the audio of decoding it whole (up to
float rounding), whatever the chunk sizes: no left context is re-decoded and nothing is cut off.

    CodecStatePool   the states of up to `capacity` streams in slots (grown when full); `decode`
                     runs one batched step for any rows: new frames of each, padded to the longest;
                     with graphs, rows are padded to 1, 2, 4 or a multiple of 8 and frames to the
                     chunk sizes, and each such shape replays a CUDA graph of the decoder's step
    CodecStreamer    frames in per stream (`feed`), chunks out (`step`): a stream's first chunk
                     is `initial_chunk_frames` frames, later ones `chunk_frames`, its last one
                     what is left once it is `finish`ed; one step decodes the ready chunk of every
                     stream in one batched call

Audio is float32 and 1-D per stream: samples_per_frame (1920 at 24 kHz) per frame.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

import torch

from mstar.models.qwen3_tts.codec import Qwen3TTSCodecDecoder
from mstar.models.shape_graphs import ShapeGraphs, graph_mode, padded_batch

MAX_CODEC_GRAPHS = 8  # shapes kept (rows x frames), least recently used dropped


class CodecStatePool:
    """Decoder states in slots: `history[i]` [capacity, ...] is stateful layer i's history of
    every slot, `positions` [capacity] the frames each slot decoded. A slot is zeroed when it is
    acquired (a new stream); the pool doubles when no slot is free.

    graphs: "off" (each call as it comes), "cuda" (padded shapes, each replayed from a CUDA graph
    captured on its first use: ShapeGraphs; CUDA only), "static" (the same padding, eagerly: how
    the CPU tests check it), "auto" ("cuda" on a CUDA decoder, else "off"). Padding rows decode
    from slot 0, kept empty for them (never acquired, never written back)."""

    def __init__(self, decoder: Qwen3TTSCodecDecoder, capacity: int = 4, graphs: str = "off"):
        self.decoder = decoder
        self.graphs = graphs = graph_mode(graphs, decoder.device, "codec state pool")
        self._first = int(graphs != "off")  # slot 0 is the padding rows' when graphs pad
        with torch.inference_mode():
            self.history = decoder.empty_history(self._first + capacity)
            self.positions = torch.zeros(self._first + capacity, dtype=torch.long, device=decoder.device)
        self._free = list(range(self._first, self._first + capacity))
        self._step = ShapeGraphs(decoder.step, max_graphs=MAX_CODEC_GRAPHS, enabled=graphs == "cuda",
                                 capture_first=True)

    @property
    def capacity(self) -> int:
        return self.positions.shape[0] - self._first

    @torch.inference_mode()
    def acquire(self) -> int:
        """A slot for a new stream, its state empty."""
        if not self._free:
            cap = self.positions.shape[0]
            self.history = [torch.cat([h, torch.zeros_like(h)]) for h in self.history]
            self.positions = torch.cat([self.positions, torch.zeros_like(self.positions)])
            self._free = list(range(cap, 2 * cap))
        slot = self._free.pop(0)
        for h in self.history:
            h[slot].zero_()
        self.positions[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        if slot in self._free or not self._first <= slot < self.positions.shape[0]:
            raise ValueError(f"codec state pool: slot {slot} is not in use")
        self._free.append(slot)

    @torch.inference_mode()
    def decode(self, slots: list[int] | torch.Tensor, codes: torch.Tensor, lengths: list[int] | torch.Tensor,
               frames: int | None = None) -> torch.Tensor:
        """One step for R rows: slots [R] (distinct, acquired), codes [R, Q, n] whose row r has
        lengths[r] new frames first (the rest padding) -> audio [R, n * samples_per_frame] float32,
        row r's first lengths[r] * samples_per_frame samples its new audio. Each slot's state
        moves on by its lengths[r] frames. frames (>= n): with graphs, the columns to pad to (the
        audio then has frames * samples_per_frame samples a row)."""
        dev = self.decoder.device
        idx = torch.as_tensor(slots, dtype=torch.long).to(dev)
        lengths = torch.as_tensor(lengths, dtype=torch.long).to(dev)
        R, n = codes.shape[0], codes.shape[-1]
        rows, cols = R, n
        if self.graphs != "off":
            rows, cols = padded_batch(R), max(n, frames or n)
            if (rows, cols) != (R, n):
                full = torch.zeros((rows, codes.shape[1], cols), dtype=codes.dtype, device=dev)
                full[:R, :, :n] = codes
                codes = full
                idx = torch.cat([idx, idx.new_zeros(rows - R)])  # padding rows: slot 0
                lengths = torch.cat([lengths, lengths.new_full((rows - R,), cols)])
        history = [h.index_select(0, idx) for h in self.history]
        audio, history = self._step(codes, lengths, self.positions.index_select(0, idx), history)
        real = idx[:R]
        for pool, h in zip(self.history, history):
            pool.index_copy_(0, real, h[:R])
        self.positions.index_add_(0, real, lengths[:R])
        return audio[:R].float()


@dataclass
class CodecChunk:
    """What one step gave a stream: `audio` [frames * samples_per_frame] float32, the audio of
    its frames first_frame .. first_frame + frames - 1; `last`: the stream's final chunk (it has
    left the streamer; the chunk may be empty when finish came after its frames were out)."""
    stream: Hashable
    audio: torch.Tensor
    first_frame: int
    frames: int
    last: bool


@dataclass
class _Stream:
    slot: int
    pending: list[torch.Tensor] = field(default_factory=list)  # [Q, k] pieces not yet decoded
    pending_frames: int = 0
    decoded_frames: int = 0
    finished: bool = False
    initial_chunk_frames: int = 4


class CodecStreamer:
    """Chunked streaming over a CodecStatePool (see the module docstring). Streams are any
    hashable ids; frames come as codes [Q, k] (or [Q] for one frame)."""

    def __init__(self, decoder: Qwen3TTSCodecDecoder, initial_chunk_frames: int = 4, chunk_frames: int = 25,
                 capacity: int = 4, graphs: str = "off"):
        if initial_chunk_frames < 1 or chunk_frames < 1:
            raise ValueError("codec streamer: chunk sizes must be >= 1 frame")
        self.decoder = decoder
        self.initial_chunk_frames, self.chunk_frames = initial_chunk_frames, chunk_frames
        self.pool = CodecStatePool(decoder, capacity, graphs)
        self._streams: dict[Hashable, _Stream] = {}

    @property
    def streams(self) -> list[Hashable]:
        return list(self._streams)

    def join(self, stream: Hashable, initial_chunk_frames: int | None = None) -> None:
        """A new stream; initial_chunk_frames: its first chunk's size (None: the streamer's)."""
        if stream in self._streams:
            raise ValueError(f"codec streamer: stream {stream!r} already joined")
        first = self.initial_chunk_frames if initial_chunk_frames is None else int(initial_chunk_frames)
        if first < 1:
            raise ValueError("codec streamer: chunk sizes must be >= 1 frame")
        self._streams[stream] = _Stream(self.pool.acquire(), initial_chunk_frames=first)

    def feed(self, stream: Hashable, codes: torch.Tensor) -> None:
        """Append frames to a stream: codes [Q, k] (k >= 0) or [Q]."""
        s = self._get(stream)
        if s.finished:
            raise ValueError(f"codec streamer: stream {stream!r} is finished")
        codes = codes[:, None] if codes.dim() == 1 else codes
        if codes.dim() != 2 or codes.shape[0] != self.decoder.config.num_quantizers:
            raise ValueError(f"codec streamer: codes must be [{self.decoder.config.num_quantizers}, k], "
                             f"got {tuple(codes.shape)}")
        if codes.shape[1]:
            s.pending.append(codes)
            s.pending_frames += codes.shape[1]

    def finish(self, stream: Hashable) -> None:
        """No more frames: the stream's remaining frames go out as its last chunk."""
        self._get(stream).finished = True

    def leave(self, stream: Hashable) -> None:
        """Drop a stream now (its undecoded frames are discarded)."""
        self.pool.release(self._streams.pop(stream).slot)

    def _want(self, s: _Stream) -> int:
        return s.initial_chunk_frames if s.decoded_frames == 0 else self.chunk_frames

    def ready(self) -> list[Hashable]:
        """The streams that a step would give a chunk: a whole chunk pending, or finished."""
        return [k for k, s in self._streams.items() if s.finished or s.pending_frames >= self._want(s)]

    def step(self) -> list[CodecChunk]:
        """Decode the ready chunk of every ready stream in one batched call, in join order."""
        ready = self.ready()
        takes = {k: min(self._want(self._streams[k]), self._streams[k].pending_frames) for k in ready}
        rows = [k for k in ready if takes[k]]
        audio = None
        if rows:
            n = max(takes[k] for k in rows)
            codes = torch.zeros((len(rows), self.decoder.config.num_quantizers, n), dtype=torch.long,
                                device=self.decoder.device)  # the frames stay on the device: no host sync
            for r, k in enumerate(rows):
                codes[r, :, :takes[k]] = self._take(self._streams[k], takes[k])
            # padded to a chunk size (graphs: few shapes); a last, shorter chunk rounds up too
            frames = min((f for f in (self.initial_chunk_frames, self.chunk_frames) if f >= n), default=n)
            audio = self.pool.decode([self._streams[k].slot for k in rows], codes, [takes[k] for k in rows], frames)
        out, spf = [], self.decoder.samples_per_frame
        for k in ready:
            s = self._streams[k]
            r = rows.index(k) if takes[k] else -1
            wav = audio[r, :takes[k] * spf] if r >= 0 else torch.zeros(0, device=self.decoder.device)
            last = s.finished and s.pending_frames == 0
            out.append(CodecChunk(k, wav, s.decoded_frames, takes[k], last))
            s.decoded_frames += takes[k]
            if last:
                self.leave(k)
        return out

    def _take(self, s: _Stream, frames: int) -> torch.Tensor:
        """The stream's next `frames` pending frames [Q, frames], removed from its queue."""
        pending = torch.cat(s.pending, dim=1)
        s.pending = [pending[:, frames:]] if pending.shape[1] > frames else []
        s.pending_frames -= frames
        return pending[:, :frames]

    def _get(self, stream: Hashable) -> _Stream:
        if stream not in self._streams:
            raise KeyError(f"codec streamer: no stream {stream!r}")
        return self._streams[stream]
