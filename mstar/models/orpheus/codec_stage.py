"""Orpheus's output stage: the audio tokens each speech request samples become 24 kHz audio as
they come, the windows of every stream of the engine step decoded in one SNAC forward.

Per request: an AudioTokenStream (tokens.py) collects its audio tokens; every complete frame from
the fourth on gives a window (the last 4 frames), decoded to 2048 samples (snac/streaming.py),
attached to that step's output as an AudioChunk(final=False). When the request finishes, its last
window's samples [4096, 8192) (the last two frames, which no window emitted) come with its
finishing output as the final chunk. A window holding a code out of range makes no audio, as in
the release.

Noise: SNAC's noise blocks draw counter-based noise from one seed per window, made of the
request's seed and the window's index, so a request's audio is a function of (seed, tokens): the
same streamed or not, alone or batched with others. Every window of a step, the finishing streams'
last ones too, goes through one forward (snac/streaming.py WindowDecoder; with graphs, replayed
from a CUDA graph on a stream of its own).
"""

from __future__ import annotations

import numpy as np
import torch

from mstar.models import interfaces as I
from mstar.models.orpheus.tokens import AudioTokenStream, window_codes
from mstar.models.snac.streaming import KEEP_FRAME, WindowDecoder

_SEED_STRIDE = 1_000_003  # window index -> noise seed offset (a prime: no collisions between nearby seeds)


def window_seed(seed: int, index: int) -> int:
    """The noise seed of a request's window `index`."""
    return (int(seed) * _SEED_STRIDE + int(index)) % (1 << 63)


class _Stream:
    __slots__ = ("seed", "tokens", "windows")

    def __init__(self, seed: int):
        self.seed = int(seed)
        self.tokens = AudioTokenStream()
        self.windows = 0  # windows taken so far


class OrpheusCodecStage(I.OutputStage):
    """graphs: WindowDecoder's (off | cuda | static | auto)."""

    def __init__(self, decoder, noise: bool = True, graphs: str = "off"):
        self.decoder = decoder
        self.device = decoder.device
        self.sample_rate = int(decoder.sampling_rate)
        self.windows = WindowDecoder(decoder, noise=noise, graphs=graphs)
        self._streams: dict[str, _Stream] = {}
        self.num_windows = 0  # decoded, for stats
        self.num_codec_steps = 0

    def add(self, request_id: str, media: I.MediaRequest) -> None:
        self._streams[request_id] = _Stream(media.seed)

    def drop(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._streams)

    def _decode(self, items) -> list[np.ndarray | None]:
        """Each item's whole window decode (None: the window is not valid), one forward for all."""
        if not items:
            return []
        ids = torch.tensor([w for _, _, w, _ in items], dtype=torch.long)
        frames, valid = window_codes(ids)
        seeds = torch.tensor([window_seed(st.seed, idx) for _, st, _, idx in items], dtype=torch.int64)
        pcm = self.windows(frames, seeds)  # the step's one read-back of audio
        ok = valid.tolist()
        return [pcm[i] if ok[i] else None for i in range(len(items))]

    def process(self, outputs: list) -> None:
        body, tails = [], []  # (output, stream, window token ids, window index)
        for o in outputs:
            st = self._streams.get(o.request_id)
            if st is None:
                continue
            if o.finish_reason == "abort":
                del self._streams[o.request_id]
                continue
            for w in st.tokens.push(o.new_token_ids):
                body.append((o, st, w, st.windows))
                st.windows += 1
            if o.finish_reason is not None:
                del self._streams[o.request_id]
                tails.append((o, st, st.tokens.last_window(), st.windows - 1))
        with_window = [t for t in tails if t[2] is not None]
        if body:
            self.num_codec_steps += 1
            self.num_windows += len(body)
        pcms = self._decode(body + with_window)
        n = self.decoder.samples_per_frame
        for (o, _, _, _), pcm in zip(body, pcms):
            if pcm is not None:
                o.media = [*(o.media or ()), I.AudioChunk(pcm[KEEP_FRAME * n:(KEEP_FRAME + 1) * n], self.sample_rate,
                                                          final=False)]
        tail_pcm = {id(t[0]): pcm for t, pcm in zip(with_window, pcms[len(body):])}
        for o, _, _, _ in tails:
            pcm = tail_pcm.get(id(o))
            pcm = np.zeros(0, dtype=np.float32) if pcm is None else pcm[(KEEP_FRAME + 1) * n:]
            o.media = [*(o.media or ()), I.AudioChunk(pcm, self.sample_rate, final=True)]
