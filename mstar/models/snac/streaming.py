"""Streaming decode of a three-codebook SNAC (24 kHz, strides [4, 2, 1]) over flat frames.

A frame is the 7 codes of one coarse step, depth first over SNAC's code tree: [c0, c1a, c2a,
c2b, c1b, c2c, c2d] -> codebook 0 gets c0, codebook 1 gets c1a, c1b, codebook 2 gets c2a, c2b,
c2c, c2d (the order Orpheus's LM emits). One frame is 4 latent steps, 2048 samples at 24 kHz.

The sliding window (what Orpheus's release glue does): after every complete frame f >= 3 the
last 4 frames [f-3 .. f] are decoded (8192 samples) and samples [2048, 4096) are kept, the
audio of frame f-2 with one frame of left and two of right context. Each step decodes the windows
of every stream that completed a frame in one batched forward (`decode_windows`).

End of a stream: the release emits nothing more, so its last two frames are never heard (and
its first frame neither, nor any audio of a stream of fewer than 4 frames). Here `decode_tail`
gives the samples [4096, 8192) of the stream's last window, frames F-2 and F-1 with the context
that window has; a stream emits it once, when it ends, after its last `decode_windows` chunk.
The first frame and streams of fewer than 4 frames stay silent as in the release. Audio of a
stream = concat(decode_windows(w) for w in sliding_windows(frames)) + decode_tail(last window),
the same whether its windows are decoded one step at a time or all in one batch.

`WindowDecoder` is the served form of one codec step: every window of the step (body and tails)
in one forward, each with its own noise seed, padded and replayed from a CUDA graph when asked.
"""

from __future__ import annotations

import numpy as np
import torch

from mstar.models.shape_graphs import ShapeGraphs, graph_mode, padded_batch
from mstar.models.snac.model import SNACDecoder

CODES_PER_FRAME = 7
WINDOW_FRAMES = 4
KEEP_FRAME = 1  # the window's frame whose samples a step emits
# frame position of each code, per codebook (time order within the frame)
FRAME_LAYOUT = ((0,), (1, 4), (2, 3, 5, 6))


def codes_from_frames(frames: torch.Tensor) -> list[torch.Tensor]:
    """frames [B, F, 7] -> the codebooks' codes [B, F], [B, 2F], [B, 4F]."""
    if frames.dim() != 3 or frames.shape[-1] != CODES_PER_FRAME:
        raise ValueError(f"frames must be [B, F, {CODES_PER_FRAME}], got {tuple(frames.shape)}")
    B, F_, _ = frames.shape
    return [frames[:, :, list(pos)].reshape(B, F_ * len(pos)) for pos in FRAME_LAYOUT]


def sliding_windows(frames: torch.Tensor) -> torch.Tensor:
    """The windows of one stream's frames [F, 7]: [F - 3, 4, 7], window w = frames w .. w+3
    (what the stream's steps decode, in order); [0, 4, 7] for F < 4."""
    if frames.shape[0] < WINDOW_FRAMES:
        return frames.new_empty((0, WINDOW_FRAMES, CODES_PER_FRAME))
    return frames.unfold(0, WINDOW_FRAMES, 1).permute(0, 2, 1).contiguous()


def _decode(decoder: SNACDecoder, windows: torch.Tensor, noise: bool, generator) -> torch.Tensor:
    if windows.dim() != 3 or windows.shape[1:] != (WINDOW_FRAMES, CODES_PER_FRAME):
        raise ValueError(f"windows must be [B, {WINDOW_FRAMES}, {CODES_PER_FRAME}], got {tuple(windows.shape)}")
    return decoder(codes_from_frames(windows), noise=noise, generator=generator)[:, 0]


def decode_windows(decoder: SNACDecoder, windows: torch.Tensor, noise: bool = True,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """One codec step: windows [B, 4, 7] (one per stream that completed a frame) -> float32
    [B, 2048], each window's frame 1 (samples [2048, 4096) of its decode)."""
    n = decoder.samples_per_frame
    if windows.shape[0] == 0:
        return torch.empty((0, n), dtype=torch.float32, device=decoder.device)
    return _decode(decoder, windows, noise, generator)[:, KEEP_FRAME * n:(KEEP_FRAME + 1) * n].float()


def decode_tail(decoder: SNACDecoder, windows: torch.Tensor, noise: bool = True,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """The final flush: windows [B, 4, 7] (each ending stream's last window) -> float32
    [B, 4096], its frames 2 and 3 (samples [4096, 8192)), which no step emitted."""
    n = decoder.samples_per_frame
    if windows.shape[0] == 0:
        return torch.empty((0, 2 * n), dtype=torch.float32, device=decoder.device)
    return _decode(decoder, windows, noise, generator)[:, (KEEP_FRAME + 1) * n:].float()


def decode_stream(decoder: SNACDecoder, frames: torch.Tensor, noise: bool = True,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """The audio the streamed path emits for one whole stream of frames [F, 7], its windows
    decoded in one batch: float32 [(F - 3) * 2048 + 4096], or [0] for F < 4."""
    windows = sliding_windows(frames)
    if windows.shape[0] == 0:
        return torch.empty((0,), dtype=torch.float32, device=decoder.device)
    n = decoder.samples_per_frame
    audio = _decode(decoder, windows, noise, generator).float()  # the last window decoded once, for both parts
    body = audio[:, KEEP_FRAME * n:(KEEP_FRAME + 1) * n].reshape(-1)
    return torch.cat([body, audio[-1, (KEEP_FRAME + 1) * n:]])


MAX_WINDOW_GRAPHS = 8  # padded window counts kept, least recently used dropped


class WindowDecoder:
    """One codec step: windows [B, 4, 7] of codes with one noise seed each (int64 [B]; counter-based
    noise, model.py) -> float32 [B, 4 * samples_per_frame] on the host, each window's whole decode
    (the caller keeps frame 1, or frames 2 and 3 for a tail).

    graphs: "off" (each step's windows as they come), "cuda" (padded to 1, 2, 4 or a multiple of 8
    windows, padding rows of code 0 and seed 0, each padded count replayed from a CUDA graph
    captured on its first use, on a CUDA stream of the decoder's own: the step's windows decode
    beside whatever the default stream runs, the LM's next step), "static" (the same padding,
    eagerly: how the CPU tests check it), "auto" ("cuda" on a CUDA decoder, else "off"). A row's
    samples do not depend on its batch, padded or not, beyond float rounding (convolutions may pick
    other kernels for another batch size)."""

    def __init__(self, decoder: SNACDecoder, noise: bool = True, graphs: str = "off"):
        self.decoder = decoder
        self.noise = bool(noise)
        self.graphs = graphs = graph_mode(graphs, decoder.device, "SNAC window decoder")
        self._forward = ShapeGraphs(self._window_audio, max_graphs=MAX_WINDOW_GRAPHS, enabled=graphs == "cuda",
                                    capture_first=True)
        self._stream = None
        if graphs == "cuda":
            torch.cuda.synchronize(decoder.device)  # the weights are in place before another stream reads them
            self._stream = torch.cuda.Stream(device=decoder.device)

    def _window_audio(self, codes: list[torch.Tensor], seeds: torch.Tensor) -> torch.Tensor:
        return self.decoder(codes, noise=self.noise, generator=seeds)[:, 0].float()

    @torch.inference_mode()
    def __call__(self, windows: torch.Tensor, seeds: torch.Tensor) -> np.ndarray:
        if windows.dim() != 3 or windows.shape[1:] != (WINDOW_FRAMES, CODES_PER_FRAME):
            raise ValueError(f"windows must be [B, {WINDOW_FRAMES}, {CODES_PER_FRAME}], got {tuple(windows.shape)}")
        B = windows.shape[0]
        if B == 0:
            return np.zeros((0, WINDOW_FRAMES * self.decoder.samples_per_frame), dtype=np.float32)
        seeds = seeds.to(torch.int64)
        if self.graphs != "off" and padded_batch(B) != B:
            pad = padded_batch(B) - B
            windows = torch.cat([windows, windows.new_zeros((pad, *windows.shape[1:]))])
            seeds = torch.cat([seeds, seeds.new_zeros(pad)])
        dev = self.decoder.device
        if self._stream is None:
            audio = self._forward(codes_from_frames(windows.to(dev)), seeds.to(dev))
            return audio[:B].cpu().numpy()
        with torch.cuda.stream(self._stream):  # no wait on the default stream: nothing read here is written there
            audio = self._forward(codes_from_frames(windows.to(dev)), seeds.to(dev))
            return audio[:B].cpu().numpy()  # waits for this stream only
