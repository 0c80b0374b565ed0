"""Orpheus's output stage: the audio tokens each speech request samples become 24 kHz audio as
they come, the windows of every stream of the engine step decoded in one SNAC forward.

Per request: an AudioTokenStream (tokens.py) collects its audio tokens; every complete frame from
the fourth on gives a window (the last 4 frames), decoded to 2048 samples (snac/streaming.py),
attached to that step's output as an AudioChunk(final=False). When the request finishes, its last
window's samples [4096, 8192) (the last two frames, which no window emitted) come with its
finishing output as the final chunk. A window holding a code out of range makes no audio, as in
the release.

Noise: SNAC's noise blocks draw from one generator per window, seeded from the request's seed and
the window's index, so a request's audio is a function of (seed, tokens): the same streamed or
not, alone or batched with others.
"""

from __future__ import annotations

import numpy as np
import torch

from mstar.models import interfaces as I
from mstar.models.orpheus.tokens import AudioTokenStream, window_codes
from mstar.models.snac.streaming import decode_tail, decode_windows

_SEED_STRIDE = 1_000_003  # window index -> generator seed offset (a prime: no collisions between nearby seeds)


class _Stream:
    __slots__ = ("seed", "tokens", "windows")

    def __init__(self, seed: int):
        self.seed = int(seed)
        self.tokens = AudioTokenStream()
        self.windows = 0  # windows taken so far


class OrpheusCodecStage(I.OutputStage):
    def __init__(self, decoder, noise: bool = True):
        self.decoder = decoder
        self.device = decoder.device
        self.sample_rate = int(decoder.sampling_rate)
        self.noise = noise
        self._streams: dict[str, _Stream] = {}
        self.num_windows = 0  # decoded, for stats
        self.num_codec_steps = 0

    def add(self, request_id: str, media: I.MediaRequest) -> None:
        self._streams[request_id] = _Stream(media.seed)

    def drop(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._streams)

    def _generators(self, items) -> list[torch.Generator] | None:
        if not self.noise:
            return None
        gens = []
        for _, st, _, idx in items:
            g = torch.Generator(device=self.device)
            g.manual_seed((st.seed * _SEED_STRIDE + idx) % (1 << 63))
            gens.append(g)
        return gens

    def _decode(self, items, tail: bool) -> list[np.ndarray | None]:
        """PCM per item (None: the window is not valid), one forward for all of them."""
        if not items:
            return []
        ids = torch.tensor([w for _, _, w, _ in items], dtype=torch.long)
        frames, valid = window_codes(ids)
        fn = decode_tail if tail else decode_windows
        audio = fn(self.decoder, frames.to(self.device), noise=self.noise, generator=self._generators(items))
        pcm = audio.cpu().numpy()  # the step's one read-back of audio
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
                last = st.tokens.last_window()
                tails.append((o, st, last, st.windows - 1))
        if body:
            self.num_codec_steps += 1
            self.num_windows += len(body)
        for (o, _, _, _), pcm in zip(body, self._decode(body, tail=False)):
            if pcm is not None:
                o.media = [*(o.media or ()), I.AudioChunk(pcm, self.sample_rate, final=False)]
        with_window = [t for t in tails if t[2] is not None]
        pcms = dict(zip((id(t[0]) for t in with_window), self._decode(with_window, tail=True)))
        for o, _, _, _ in tails:
            pcm = pcms.get(id(o))
            if pcm is None:
                pcm = np.zeros(0, dtype=np.float32)
            o.media = [*(o.media or ()), I.AudioChunk(pcm, self.sample_rate, final=True)]
