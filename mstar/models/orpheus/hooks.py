"""Orpheus's engine hooks: the codec stage the LM's tokens feed, the request's prompt and
sampling, and the per-position restriction of the logits to that frame position's audio tokens
(family.py says why)."""

from __future__ import annotations

import os

import torch

from mstar import knobs
from mstar.models import interfaces as I
from mstar.models.orpheus import tokens as T
from mstar.models.orpheus.family import find_codec

MAX_INPUT_CHARS = 4096


def load_codec(codec: str, device: torch.device, random_weights: bool, seed: int):
    from mstar.models.snac.model import build_snac_decoder, load_snac_decoder
    from mstar.models.snac.presets import PRESETS as SNAC_PRESETS
    if os.path.isdir(codec):
        return load_snac_decoder(codec, dtype=torch.float32, device=device)
    if codec not in SNAC_PRESETS:
        raise ValueError(f"codec: {codec!r} is neither a directory nor a SNAC preset ({', '.join(SNAC_PRESETS)})")
    return build_snac_decoder(SNAC_PRESETS[codec], dtype=torch.float32, device=device, seed=seed)


class OrpheusHooks(I.EngineHooks):
    constrains_logits = True

    def __init__(self, model, engine_config):
        from mstar.models.orpheus.codec_stage import OrpheusCodecStage
        from mstar.models.tokenizer import load_tokenizer
        name = str(engine_config.model)
        self.device = model.device
        self.vocab_size = int(model.config.vocab_size)
        self.tokenizer = load_tokenizer(name)
        decoder = load_codec(find_codec(name, engine_config.codec), self.device, engine_config.random_weights,
                             int(engine_config.seed))
        self.output_stage = OrpheusCodecStage(decoder, graphs="auto" if knobs.value("MSTAR_SNAC_GRAPHS") else "off")
        self.accepts = {"voices": list(T.VOICES), "max_input_chars": MAX_INPUT_CHARS, "speeds": [1.0],
                        "sample_rate": self.output_stage.sample_rate}
        self._cands = None  # [CODES_PER_FRAME, CODEBOOK_SIZE + 1] candidate ids per frame position (_position_ids)
        self._bias = None  # [CODES_PER_FRAME + 1, vocab] additive mask (0 / -inf) per frame position, built on first use
        # the tokens constrain_logits ever allows: the seven codebooks' ranges and end of speech
        audio = torch.arange(T.AUDIO_TOKEN_BASE, T.AUDIO_TOKEN_BASE + T.CODES_PER_FRAME * T.CODEBOOK_SIZE)
        ids = torch.cat([audio, torch.tensor([T.END_OF_SPEECH])]).unique()
        self.logit_ids = ids[ids < self.vocab_size].to(self.device)
        self.max_allowed_tokens = T.CODEBOOK_SIZE + 1  # a position's codes (+ end of speech at a frame start)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def media_request(self, media: I.MediaRequest):
        inp = media.inputs
        text = inp.get("text")
        if not isinstance(text, str) or not text.strip():
            raise ValueError("input: the text is empty")
        if float(inp.get("speed", 1.0)) != 1.0:
            raise ValueError("speed: this model speaks at one speed; use 1.0")
        if inp.get("instructions"):
            raise ValueError("instructions: this model takes none (emotion tags such as <laugh> go in the input)")
        params = dict(T.DEFAULT_SAMPLING)
        n = inp.get("max_new_tokens")
        if n is not None:
            params["max_tokens"] = int(n)
        params.update(seed=int(media.seed), stop_token_ids=list(T.STOP_TOKEN_IDS), ignore_eos=True)
        return T.format_prompt(self._encode, text, inp.get("voice")), params

    def _position_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """Row p < 7: 0 on the audio ids of frame position p (and, at p = 0, end of speech), -inf
        elsewhere; row 7: zeros (a row that is not a speech request)."""
        if self._bias is None or self._bias.dtype != dtype:
            v = torch.arange(self.vocab_size, device=self.device)[None, :]
            lo = (T.AUDIO_TOKEN_BASE + torch.arange(T.CODES_PER_FRAME, device=self.device) * T.CODEBOOK_SIZE)[:, None]
            keep = (v >= lo) & (v < lo + T.CODEBOOK_SIZE)
            keep[0] |= v[0] == T.END_OF_SPEECH  # speech ends only at a frame boundary
            keep = torch.cat([keep, torch.ones_like(keep[:1])])
            self._bias = torch.zeros(keep.shape, dtype=dtype, device=self.device).masked_fill_(~keep, float("-inf"))
        return self._bias

    def _position_ids(self) -> torch.Tensor:
        """[CODES_PER_FRAME, CODEBOOK_SIZE + 1]: row p the tokens _position_bias allows at frame
        position p, ascending (end of speech, below every audio id, first at p = 0), -1 padding."""
        if self._cands is None:
            lo = T.AUDIO_TOKEN_BASE + torch.arange(T.CODES_PER_FRAME) * T.CODEBOOK_SIZE
            codes = lo[:, None] + torch.arange(T.CODEBOOK_SIZE)[None, :]
            pad = torch.full((T.CODES_PER_FRAME - 1, 1), -1, dtype=torch.long)
            ids = torch.cat([torch.cat([torch.tensor([T.END_OF_SPEECH]), codes[0]])[None],
                             torch.cat([codes[1:], pad], dim=1)])
            if int(ids.max()) >= self.vocab_size:
                raise ValueError(f"Orpheus: a vocabulary of {self.vocab_size} ids does not hold every audio token")
            self._cands = ids.to(self.device)
        return self._cands

    def candidate_ids(self, request_ids, num_output_tokens):
        if any(r is None for r in request_ids):
            return None
        pos = torch.tensor([n % T.CODES_PER_FRAME for n in num_output_tokens], dtype=torch.long)
        return self._position_ids()[pos.to(self.device, non_blocking=True)]

    def constrain_logits(self, logits, request_ids, num_output_tokens) -> None:
        pos = [n % T.CODES_PER_FRAME if r is not None else T.CODES_PER_FRAME
               for r, n in zip(request_ids, num_output_tokens)]
        rows = torch.tensor(pos, dtype=torch.long).to(self.device, non_blocking=True)
        logits += self._position_bias(logits.dtype)[rows]


