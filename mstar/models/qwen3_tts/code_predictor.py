"""The Qwen3-TTS code predictor on mstar.ops: codebooks 1..G-1 of a frame, after the talker chose
codebook 0.

A Qwen3 decoder (default rotary, positions 0..G-1) run once per frame over a fresh sequence:

    position 0        the talker's last hidden state (after its final norm)
    position 1        the talker's embedding of codebook 0 (its codec_embedding)
    position j >= 2   codec_embedding[j - 2] of codebook j - 1 (this module's own tables)

each projected to the predictor's width (`small_to_mtp_projection`, a biased linear, when the
widths differ). The output at position j goes through lm_head[j - 1] and yields codebook j, so a
frame is one forward of two positions, then G - 2 forwards of one. Its embedding tables are the
talker's width: the sum of a frame's G embeddings is the talker's next input (Talker.frame_embeds).

K/V: one page of G positions per batch row (row r uses page r), filled from position 0 each
frame. The metadata of every sub-step depends only on the number of rows, so it is built once per
batch size and reused: the G - 1 sub-steps of a frame have static shapes and no host work.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mstar.models.base import DecoderLayer
from mstar.models.context import AttentionMetadata, ForwardContext
from mstar.models.layers import GatedMLP, Linear, QKNormAttention, RMSNorm, RotaryCache
from mstar.models.qwen3_tts.config import CodePredictorConfig


def decoder_layer(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                  bias: bool) -> DecoderLayer:
    """A Qwen3 decoder layer (checkpoint names self_attn.*, mlp.*, *_layernorm); the talker's too."""
    attn = QKNormAttention(hidden=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, eps=eps,
                           zero_centered_norm=False, output_gate=False, bias=bias)
    return DecoderLayer("self_attn", attn, GatedMLP(hidden, intermediate), hidden, eps, zero_centered=False)


def run_decoder(layers: nn.ModuleList, norm: RMSNorm, ctx: ForwardContext, h: torch.Tensor,
                rope: RotaryCache) -> torch.Tensor:
    """The pre-norm residual stream through `layers`, then the final norm: [T, hidden]."""
    residual = None
    for layer in layers:
        h, residual = layer(ctx, h, residual, rope)
    return norm.add_forward(h, residual)[0]


class PredictorModel(nn.Module):
    """What checkpoints call `talker.code_predictor.model.*` (less codec_embedding, see CodePredictor)."""

    def __init__(self, c: CodePredictorConfig):
        super().__init__()
        self.layers = nn.ModuleList(decoder_layer(c.hidden_size, c.intermediate_size, c.num_attention_heads,
                                                  c.num_key_value_heads, c.head_dim, c.rms_norm_eps,
                                                  c.attention_bias) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class CodePredictor(nn.Module):
    """`talker.code_predictor.*`. The G - 1 embedding tables and heads are stacked:
    codec_embeddings[i] is the checkpoint's model.codec_embedding.{i}, lm_heads[i] its lm_head.{i}."""

    def __init__(self, config: CodePredictorConfig, talker_hidden: int):
        super().__init__()
        c = self.config = config
        self.num_code_groups = G = c.num_code_groups
        self.model = PredictorModel(c)
        self.codec_embeddings = nn.Parameter(torch.empty(G - 1, c.vocab_size, talker_hidden))
        self.lm_heads = nn.Parameter(torch.empty(G - 1, c.vocab_size, c.hidden_size))
        self.small_to_mtp_projection = (Linear(talker_hidden, c.hidden_size, bias=True)
                                        if talker_hidden != c.hidden_size else None)
        self.rope = RotaryCache(G, c.head_dim, c.rope_theta)
        self._contexts: dict[int, tuple[ForwardContext, list[ForwardContext]]] = {}
        self.max_rows = 0

    @property
    def attention_layers(self):
        return [layer.self_attn for layer in self.model.layers]

    def bind_cache(self, max_rows: int, device=None, dtype: torch.dtype | None = None) -> None:
        """K/V for up to `max_rows` rows per frame: [max_rows, G, Hkv, D] per layer."""
        device, dtype = device or self.lm_heads.device, dtype or self.lm_heads.dtype
        for a in self.attention_layers:
            shape = (max_rows, self.num_code_groups, a.num_kv_heads, a.head_dim)
            a.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            a.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.max_rows = int(max_rows)
        self._contexts.clear()

    def _build_contexts(self, B: int) -> tuple[ForwardContext, list[ForwardContext]]:
        """The prefill context (positions 0, 1 of every row) and one decode context per later position."""
        G, dev = self.num_code_groups, self.lm_heads.device
        rows = np.arange(B, dtype=np.int64)
        page = torch.from_numpy(rows.astype(np.int32)).to(dev)
        ind = torch.from_numpy(np.arange(B + 1, dtype=np.int32))  # one page per row, on the host
        none32, one0 = torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)

        def to_dev(x):
            return torch.from_numpy(x).to(dev)

        pos = np.tile(np.arange(2, dtype=np.int64), B)
        pre = ForwardContext(input_ids=to_dev(pos), positions=to_dev(pos), num_decode_tokens=0, attn=AttentionMetadata(
            slot_mapping=to_dev(np.repeat(rows * G, 2) + pos), decode_kv_indptr=one0,
            decode_kv_indices=none32.to(dev), decode_kv_last_page_len=none32,
            prefill_qo_indptr=torch.from_numpy(np.arange(B + 1, dtype=np.int32) * 2), prefill_kv_indptr=ind,
            prefill_kv_indices=page, prefill_kv_last_page_len=torch.full((B,), 2, dtype=torch.int32)))
        steps = []
        for j in range(2, G):
            pj = np.full(B, j, dtype=np.int64)
            # each step its own indptr: attention backends key their plans on it, and the steps'
            # plans differ (every row's key count grows by one a step)
            steps.append(ForwardContext(input_ids=to_dev(pj), positions=to_dev(pj), num_decode_tokens=B,
                                        attn=AttentionMetadata(
                slot_mapping=to_dev(rows * G + j), decode_kv_indptr=ind.clone(), decode_kv_indices=page,
                decode_kv_last_page_len=torch.full((B,), j + 1, dtype=torch.int32), prefill_qo_indptr=one0,
                prefill_kv_indptr=one0, prefill_kv_indices=none32.to(dev), prefill_kv_last_page_len=none32)))
        return pre, steps

    def contexts(self, B: int) -> tuple[ForwardContext, list[ForwardContext]]:
        """The (cached) step contexts of a frame of B rows."""
        if B > self.max_rows:
            raise ValueError(f"qwen3-tts code predictor: {B} rows, the cache holds {self.max_rows} (bind_cache)")
        if B not in self._contexts:
            self._contexts[B] = self._build_contexts(B)
        return self._contexts[B]

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.small_to_mtp_projection is None else self.small_to_mtp_projection(x)

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """[B, G-1] codes of codebooks 1..G-1 -> [B, G-1, talker hidden] (table i for codebook i + 1)."""
        V = self.config.vocab_size
        offsets = torch.arange(codes.shape[1], device=codes.device) * V
        return F.embedding(codes + offsets, self.codec_embeddings.view(-1, self.codec_embeddings.shape[-1]))

    def forward(self, ctx: ForwardContext, x: torch.Tensor) -> torch.Tensor:
        return run_decoder(self.model.layers, self.model.norm, ctx, self.project(x), self.rope)

    def logits(self, hidden: torch.Tensor, codebook: int) -> torch.Tensor:
        """float32 [B, vocab] logits of codebook `codebook` (1..G-1) from the outputs at its position."""
        return F.linear(hidden, self.lm_heads[codebook - 1]).float()

    def generate(self, hidden: torch.Tensor, code0: torch.Tensor, code0_embed: torch.Tensor,
                 sample: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
        """A frame's codes [B, G] int64 from the talker's last hidden states [B, Ht], codebook 0 [B]
        and its talker embedding [B, Ht]; sample(logits [B, V] float32, codebook j) -> [B] draws
        codebook j."""
        B, G = hidden.shape[0], self.num_code_groups
        pre, steps = self.contexts(B)
        codes = torch.empty((B, G), dtype=torch.int64, device=hidden.device)
        codes[:, 0] = code0
        h = self(pre, torch.stack((hidden, code0_embed), 1).reshape(2 * B, -1))[1::2]
        codes[:, 1] = sample(self.logits(h, 1), 1)
        for j in range(2, G):
            x = F.embedding(codes[:, j - 1], self.codec_embeddings[j - 2])
            h = self(steps[j - 2], x)
            codes[:, j] = sample(self.logits(h, j), j)
        return codes
