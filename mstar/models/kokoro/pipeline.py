"""KokoroPipeline: Kokoro as one one-shot stage of the stage engine.

A request's inputs (interfaces.MediaRequest.inputs):

    phonemes   Kokoro's phoneme string, used as given (symbols outside the vocab dropped); or
    input / text
               text, turned into phonemes by g2p.py (espeak-ng; see its docstring for the quality)
    voice      a loaded voice name (default: the first); its first letter picks the G2P language
    language   optional espeak-ng language for the text ("en-us", "en-gb", "fr-fr", ...)
    speed      > 0 (default 1): durations are divided by it
    durations  benchmark hook: an int (frames for every token, the two boundary pads included) or
               one int per token (len(phonemes) + 2, pads included) pinning the frame counts, since
               random weights predict meaningless durations (about max_dur / 2 frames per token,
               25 for the published shape: 15 000 samples per phoneme)

An utterance longer than the model's context (510 phonemes) is cut into chunks at sentence
punctuation, else other punctuation, else a space; each chunk is a row of the forward with the
voice row of its own length, and the request's audio comes back as one AudioChunk per chunk
(float32 PCM at 24 kHz, `final` on the last), in order.

Batching: batch_key buckets a request by its longest chunk's token count, rounded up to a power
of two, so requests of similar lengths share a forward; at most `max_rows` chunks go into one
forward. Randomness (the source's phases and noise) comes from a generator seeded with the
request's seed, consumed by its chunks in order: a request's audio is a function of (seed, inputs)
on a given device, whatever it is batched with. A request the pipeline cannot take (unknown voice,
no phonemes, bad durations) fails in batch_key, alone.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from mstar.models import interfaces as I
from mstar.models.kokoro import g2p
from mstar.models.kokoro.model import KokoroModel, SynthesisRow
from mstar.models.kokoro.voices import VoiceBank

_SENTENCE = frozenset(".!?\u2026")
_CLAUSE = frozenset(",;:\u2014)\u201d\"")


def split_phonemes(ps: str, limit: int) -> list[str]:
    """Chunks of at most `limit` symbols, cut after sentence punctuation, else after other
    punctuation, else at a space, else hard at the limit."""
    out = []
    ps = ps.strip()
    while len(ps) > limit:
        window = ps[:limit]
        cut = 0
        for marks in (_SENTENCE, _CLAUSE):
            cut = max((i + 1 for i, ch in enumerate(window) if ch in marks), default=0)
            if cut:
                break
        if not cut:
            cut = window.rfind(" ") if " " in window else limit
        if cut <= 0:
            cut = limit
        out.append(ps[:cut].strip())
        ps = ps[cut:].strip()
    if ps:
        out.append(ps)
    return [c for c in out if c]


def _bucket(n: int) -> int:
    return 1 << max(3, math.ceil(math.log2(max(n, 1))))


class KokoroPipeline(I.Pipeline):
    def __init__(self, model: KokoroModel, voices: VoiceBank, *, max_batch: int = 8, max_rows: int | None = None,
                 max_input_chars: int = 4096, use_g2p: bool = True):
        if not voices.names:
            raise ValueError("kokoro: no voices (a checkpoint directory needs voices/<name>.pt)")
        super().__init__(stages=[I.OneShotStage(self.run, batch_key=self.batch_key, max_batch=max_batch)],
                         accepts={"voices": voices.names, "max_input_chars": int(max_input_chars),
                                  "phonemes": True})
        self.model = model
        self.voices = voices
        self.vocab = dict(model.config.vocab)
        self._vocab_set = frozenset(self.vocab)
        self.max_rows = int(max_rows or max_batch)
        self.max_input_chars = int(max_input_chars)
        self.use_g2p = use_g2p
        self.sample_rate = int(model.config.sample_rate)

    # -- requests -> rows -----------------------------------------------------------------------
    def phonemes(self, inputs: dict[str, Any]) -> str:
        ps = inputs.get("phonemes")
        if ps is not None:
            if not isinstance(ps, str):
                raise ValueError("phonemes must be a string")
            if len(ps) > 4 * self.max_input_chars:
                raise ValueError(f"phonemes: {len(ps)} symbols; at most {4 * self.max_input_chars}")
            return "".join(ch for ch in ps if ch in self._vocab_set)
        text = inputs.get("input", inputs.get("text"))
        if not isinstance(text, str):
            raise ValueError("kokoro takes `phonemes` or text (`input` / `text`)")
        if len(text) > self.max_input_chars:
            raise ValueError(f"input: {len(text)} characters; at most {self.max_input_chars}")
        if not self.use_g2p:
            raise ValueError("this Kokoro pipeline has no text front end: pass `phonemes`")
        lang = inputs.get("language") or g2p.language_of_voice(self.voice(inputs))
        return g2p.to_phonemes(text, str(lang), self._vocab_set)

    def voice(self, inputs: dict[str, Any]) -> str:
        v = inputs.get("voice") or self.voices.names[0]
        if v not in self.voices:
            raise ValueError(f"voice {v!r} is not loaded; voices: {', '.join(self.voices.names)}")
        return v

    def prepare(self, req: I.MediaRequest) -> list[SynthesisRow]:
        """The rows of one request (no generator yet); raises on inputs it cannot take."""
        inputs = req.inputs
        voice = self.voice(inputs)
        speed = inputs.get("speed")
        speed = 1.0 if speed is None else float(speed)
        if not math.isfinite(speed) or speed <= 0:
            raise ValueError(f"speed must be a positive number, got {speed}")
        ps = self.phonemes(inputs)
        chunks = split_phonemes(ps, self.model.config.max_phonemes)
        if not chunks:
            raise ValueError("the input has no phonemes in Kokoro's vocabulary")
        dur = inputs.get("durations")
        if dur is not None:
            if isinstance(dur, bool) or not (isinstance(dur, int) or isinstance(dur, (list, tuple))):
                raise ValueError("durations must be an int or a list of ints")
            if isinstance(dur, (list, tuple)):
                if len(chunks) != 1:
                    raise ValueError("a durations list needs phonemes that fit one chunk")
                dur = [int(x) for x in dur]
                n = len(chunks[0]) + 2
                if len(dur) != n:
                    raise ValueError(f"durations: {len(dur)} given, {n} tokens (the phonemes and two boundary pads)")
            if min([dur] if isinstance(dur, int) else dur) < 1:
                raise ValueError("durations must be at least 1 frame")
        rows = []
        for c in chunks:
            ids = [self.vocab[ch] for ch in c]
            rows.append(SynthesisRow(ids, self.voices.style(voice, len(ids)), speed, dur))
        return rows

    def batch_key(self, req: I.MediaRequest) -> int:
        return _bucket(max(len(r.ids) + 2 for r in self.prepare(req)))

    # -- the stage ------------------------------------------------------------------------------
    def run(self, reqs: list[I.MediaRequest]) -> list[list[I.AudioChunk]]:
        dev = self.model.device
        rows, owner = [], []
        for k, req in enumerate(reqs):
            g = torch.Generator(device=dev).manual_seed(int(req.seed))
            for r in self.prepare(req):
                r.generator = g
                rows.append(r)
                owner.append(k)
        pcm: list[np.ndarray] = []
        for i in range(0, len(rows), self.max_rows):
            for o in self.model(rows[i:i + self.max_rows]):
                pcm.append(np.clip(o.audio.float().cpu().numpy(), -1.0, 1.0).astype(np.float32))
        out: list[list[I.AudioChunk]] = [[] for _ in reqs]
        for k, a in zip(owner, pcm):
            out[k].append(I.AudioChunk(a, self.sample_rate, final=False))
        for chunks in out:
            chunks[-1].final = True
        return out


__all__ = ["KokoroPipeline", "split_phonemes"]
