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
        # row p: the tokens frame position p allows, ascending (end of speech, below every audio id,
        # first at p = 0: speech ends only at a frame boundary), -1 padding; the one source of the
        # head's ids, the constraint's mask and the candidate columns
        lo = T.AUDIO_TOKEN_BASE + torch.arange(T.CODES_PER_FRAME) * T.CODEBOOK_SIZE
        codes = lo[:, None] + torch.arange(T.CODEBOOK_SIZE)[None, :]
        pad = torch.full((T.CODES_PER_FRAME - 1, 1), -1, dtype=torch.long)
        cands = torch.cat([torch.cat([torch.tensor([T.END_OF_SPEECH]), codes[0]])[None],
                           torch.cat([codes[1:], pad], dim=1)])
        if int(cands.max()) >= self.vocab_size:
            raise ValueError(f"Orpheus: a vocabulary of {self.vocab_size} ids does not hold every audio token")
        self._cands = cands.to(self.device)  # [CODES_PER_FRAME, CODEBOOK_SIZE + 1]
        self.logit_ids = cands[cands >= 0].unique().to(self.device)  # every token a speech row can be
        self.max_allowed_tokens = T.CODEBOOK_SIZE + 1
        self._bias = None  # [CODES_PER_FRAME + 1, vocab] additive mask (0 / -inf) per frame position, built on first use

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
        """Row p < 7: 0 on the tokens frame position p allows, -inf elsewhere; row 7: zeros (a row
        that is not a speech request)."""
        if self._bias is None or self._bias.dtype != dtype:
            bias = torch.full((T.CODES_PER_FRAME + 1, self.vocab_size), float("-inf"), dtype=dtype, device=self.device)
            bias[-1] = 0
            for p, row in enumerate(self._cands):
                bias[p, row[row >= 0]] = 0
            self._bias = bias
        return self._bias

    def candidate_ids(self, request_ids, num_output_tokens):
        if any(r is None for r in request_ids):
            return None
        pos = torch.tensor([n % T.CODES_PER_FRAME for n in num_output_tokens], dtype=torch.long)
        return self._cands[pos.to(self.device, non_blocking=True)]

    def constrain_logits(self, logits, request_ids, num_output_tokens) -> None:
        pos = [n % T.CODES_PER_FRAME if r is not None else T.CODES_PER_FRAME
               for r, n in zip(request_ids, num_output_tokens)]
        rows = torch.tensor(pos, dtype=torch.long).to(self.device, non_blocking=True)
        logits += self._position_bias(logits.dtype)[rows]


