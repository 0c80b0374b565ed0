"""Kokoro-82M (StyleTTS2's inference graph with an iSTFTNet decoder) as one batched forward.

    rows (phoneme ids, voice row ref_s, speed, [pinned durations], generator)
      -> token ids [0, *ids, 0] per row (0 pads and bounds)
      -> PL-BERT (packed tokens) -> bert_encoder -> duration encoder (+ predictor style) -> LSTM
      -> durations per token: round(sum(sigmoid(logits)) / speed), at least 1 frame
      -> per row: token features repeated by their durations (the alignment), rows padded to the
         batch's most frames
      -> F0 / N curves (predictor) and the text encoder's features (aligned the same way)
      -> decoder (+ decoder style) -> one float32 waveform per row, its own length

Module names are the release's: bert, bert_encoder, predictor, text_encoder, decoder (the five
state dicts of kokoro-v1_0.pth). A voice row ref_s is [2 * style_dim]: ref_s[:style_dim] goes to
the decoder, ref_s[style_dim:] to the predictor.

Precision: LSTMs, normalisation statistics, the harmonic source and the (i)STFT run in float32;
convolutions and linears in the model's dtype (`to_dtype`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mstar.models.kokoro.blocks import length_mask
from mstar.models.kokoro.config import KokoroConfig
from mstar.models.kokoro.istftnet import Decoder
from mstar.models.kokoro.plbert import PLBert
from mstar.models.kokoro.prosody import ProsodyPredictor
from mstar.models.kokoro.text_encoder import TextEncoder


@dataclass
class SynthesisRow:
    """One utterance of at most config.max_phonemes phoneme ids (no boundary pads).

    durations: None (predicted), an int (that many frames for every token, the two boundary pads
    included) or len(ids) + 2 ints (per token, pads included): pinned frame counts, for benchmarks
    of random weights, whose predicted durations are meaningless (about max_dur / 2 frames each).
    generator: the row's randomness (the source's initial phases and noise); None: torch's global
    generator."""
    ids: list[int]
    ref_s: torch.Tensor
    speed: float = 1.0
    durations: int | list[int] | None = None
    generator: torch.Generator | None = None


@dataclass
class SynthesisOutput:
    audio: torch.Tensor  # float32 [durations.sum() * config.samples_per_frame]
    durations: torch.Tensor  # int64 [len(ids) + 2], host


class KokoroModel(nn.Module):
    def __init__(self, config: KokoroConfig):
        super().__init__()
        self.config = c = config
        self.bert = PLBert(c.n_token, c.plbert)
        self.bert_encoder = nn.Linear(self.bert.hidden_size, c.hidden_dim)
        self.predictor = ProsodyPredictor(c.style_dim, c.hidden_dim, c.n_layer, c.max_dur)
        self.text_encoder = TextEncoder(c.hidden_dim, c.text_encoder_kernel_size, c.n_layer, c.n_token)
        self.decoder = Decoder(c.hidden_dim, c.style_dim, c.istftnet, c.decoder_dim, c.decoder_res_dim, c.sample_rate)

    @property
    def device(self) -> torch.device:
        return self.bert_encoder.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.bert_encoder.weight.dtype

    def to_dtype(self, dtype: torch.dtype) -> "KokoroModel":
        """Convs and linears in dtype; LSTMs stay float32 (their recurrences drift in half precision)."""
        self.to(dtype)
        for mod in self.modules():
            if isinstance(mod, nn.LSTM):
                mod.float()
        return self

    @staticmethod
    def _pinned(d: int | list[int], n: int) -> torch.Tensor:
        if isinstance(d, int):
            out = torch.full((n,), d, dtype=torch.long)
        else:
            out = torch.tensor([int(x) for x in d], dtype=torch.long)
            if out.shape != (n,):
                raise ValueError(f"durations: {len(d)} given for {n} tokens (the phonemes and the two boundary pads)")
        if int(out.min()) < 1:
            raise ValueError("durations: every token needs at least one frame")
        return out

    @torch.inference_mode()
    def forward(self, rows: list[SynthesisRow]) -> list[SynthesisOutput]:
        c, dev, dt = self.config, self.device, self.dtype
        B = len(rows)
        toks = [[0, *r.ids, 0] for r in rows]
        lengths = torch.tensor([len(t) for t in toks], dtype=torch.long)
        if int(lengths.max()) > c.context_length:
            raise ValueError(f"kokoro: {int(lengths.max()) - 2} phonemes in one row; at most {c.context_length - 2}")
        L = int(lengths.max())
        ids = torch.zeros(B, L, dtype=torch.long)
        for b, t in enumerate(toks):
            ids[b, :len(t)] = torch.tensor(t, dtype=torch.long)
        ids = ids.to(dev)
        flat = torch.cat([ids[b, :int(n)] for b, n in enumerate(lengths)])
        tok_m = length_mask(lengths, L, dt, dev)  # [B, 1, L]
        ref = torch.stack([r.ref_s.reshape(-1) for r in rows]).to(device=dev, dtype=dt)
        s_dec, s_pred = ref[:, :c.style_dim], ref[:, c.style_dim:]

        # PL-BERT over packed tokens, back to padded rows
        bert = self.bert_encoder(self.bert(flat, lengths))
        d_en = bert.new_zeros(B, L, bert.shape[-1])
        d_en[tok_m[:, 0].bool()] = bert
        d = self.predictor.text_encoder(d_en, s_pred, lengths, tok_m.transpose(1, 2))  # [B, L, hidden + style]

        # durations
        logits = self.predictor.duration_logits(d, lengths).float()
        speed = torch.tensor([float(r.speed) for r in rows], device=dev, dtype=torch.float32)[:, None]
        pred = torch.round(torch.sigmoid(logits).sum(-1) / speed).clamp(min=1).long().cpu()
        durs = [self._pinned(r.durations, int(n)) if r.durations is not None else pred[b, :int(n)]
                for b, (r, n) in enumerate(zip(rows, lengths))]
        frames = torch.stack([x.sum() for x in durs])
        Fm = int(frames.max())

        # alignment: each token's features repeated over its frames (the one-hot matmul of the
        # release, without the matmul)
        t_en = self.text_encoder(ids, lengths, tok_m)  # [B, hidden, L]
        d_t = d.transpose(1, 2)
        en = d_t.new_zeros(B, d_t.shape[1], Fm)
        asr = t_en.new_zeros(B, t_en.shape[1], Fm)
        for b, (x, n) in enumerate(zip(durs, lengths)):
            rep = x.to(dev)
            f = int(frames[b])
            en[b, :, :f] = d_t[b, :, :int(n)].repeat_interleave(rep, dim=-1, output_size=f)
            asr[b, :, :f] = t_en[b, :, :int(n)].repeat_interleave(rep, dim=-1, output_size=f)
        fr_m = length_mask(frames, Fm, dt, dev)
        f0, n_curve, _ = self.predictor.f0_n(en, s_pred, frames, fr_m)
        audio = self.decoder(asr, f0, n_curve, s_dec, frames, [r.generator for r in rows])
        return [SynthesisOutput(a, x) for a, x in zip(audio, durs)]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


__all__ = ["KokoroModel", "SynthesisRow", "SynthesisOutput"]
