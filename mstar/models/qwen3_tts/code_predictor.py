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

K/V: every row keeps its own G positions ([max_rows, G, Hkv, D] per layer), written at the
sub-step's positions and attended densely (ops.dense_attention): a frame's sub-steps have static
shapes, static positions and no host work, so a frame can be captured in a CUDA graph
(frame_graphs.py). The per-sub-step layout of B rows is built once per batch size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mstar import ops
from mstar.models.base import DecoderLayer
from mstar.models.layers import GatedMLP, Linear, QKNormAttention, RMSNorm, RotaryCache
from mstar.models.qwen3_tts.config import CodePredictorConfig


@dataclass(frozen=True)
class RowStep:
    """One predictor forward over B rows: `count` positions per row from `start` on (row-major
    tokens), positions [B * count] on the device, the rows' query / key offsets on the host."""
    rows: int
    start: int
    count: int
    positions: torch.Tensor
    q_indptr: torch.Tensor
    kv_indptr: torch.Tensor


class RowCacheAttention(QKNormAttention):
    """The predictor's attention: row r's K/V in k_cache[r, :G], written at the step's static
    positions, attended causally over positions 0 .. start + count - 1."""

    def core(self, ctx: RowStep, pre: tuple[torch.Tensor, ...], rope: RotaryCache) -> torch.Tensor:
        qkv, = pre
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = ops.qk_norm_rope(qkv, ctx.positions, self.q_norm.weight, self.k_norm.weight, rope.cos_sin_cache,
                                   hq, hk, d, rope.rotary_dim, self.q_norm.eps, self.q_norm.zero_centered, False)
        B, j0, n = ctx.rows, ctx.start, ctx.count
        self.k_cache[:B, j0:j0 + n] = k.view(B, n, hk, d)
        self.v_cache[:B, j0:j0 + n] = v.view(B, n, hk, d)
        L = j0 + n
        keys = self.k_cache[:B, :L].reshape(B * L, hk, d)
        values = self.v_cache[:B, :L].reshape(B * L, hk, d)
        o = ops.dense_attention(q, keys, values, ctx.q_indptr, ctx.kv_indptr, self.scale, True)
        return o.reshape(q.shape[0], hq * d)


def decoder_layer(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                  bias: bool, attention: type[QKNormAttention] = QKNormAttention) -> DecoderLayer:
    """A Qwen3 decoder layer (checkpoint names self_attn.*, mlp.*, *_layernorm); the talker's too."""
    attn = attention(hidden=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, eps=eps,
                     zero_centered_norm=False, output_gate=False, bias=bias)
    return DecoderLayer("self_attn", attn, GatedMLP(hidden, intermediate), hidden, eps, zero_centered=False)


def run_decoder(layers: nn.ModuleList, norm: RMSNorm, ctx, h: torch.Tensor,
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
                                                  c.attention_bias, RowCacheAttention)
                                    for _ in range(c.num_hidden_layers))
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
        self._steps: dict[int, list[RowStep]] = {}
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
        self._steps.clear()

    def steps(self, B: int) -> list[RowStep]:
        """The (cached) forwards of a frame of B rows: positions 0 and 1, then one position each."""
        if B > self.max_rows:
            raise ValueError(f"qwen3-tts code predictor: {B} rows, the cache holds {self.max_rows} (bind_cache)")
        if B not in self._steps:
            dev, G = self.lm_heads.device, self.num_code_groups
            rows = torch.arange(B + 1, dtype=torch.int32)
            self._steps[B] = [RowStep(B, j0, n, torch.arange(j0, j0 + n, device=dev).repeat(B), rows * n,
                                      rows * (j0 + n))
                              for j0, n in [(0, 2)] + [(j, 1) for j in range(2, G)]]
        return self._steps[B]

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.small_to_mtp_projection is None else self.small_to_mtp_projection(x)

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """[B, G-1] codes of codebooks 1..G-1 -> [B, G-1, talker hidden] (table i for codebook i + 1)."""
        V = self.config.vocab_size
        offsets = torch.arange(codes.shape[1], device=codes.device) * V
        return F.embedding(codes + offsets, self.codec_embeddings.view(-1, self.codec_embeddings.shape[-1]))

    def forward(self, ctx: RowStep, x: torch.Tensor) -> torch.Tensor:
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
        pre, *steps = self.steps(B)
        codes = torch.empty((B, G), dtype=torch.int64, device=hidden.device)
        codes[:, 0] = code0
        h = self(pre, torch.stack((hidden, code0_embed), 1).reshape(2 * B, -1))[1::2]
        codes[:, 1] = sample(self.logits(h, 1), 1)
        for j in range(2, G):
            x = F.embedding(codes[:, j - 1], self.codec_embeddings[j - 2])
            h = self(steps[j - 2], x)
            codes[:, j] = sample(self.logits(h, j), j)
        return codes
