"""The Qwen3-TTS 12 Hz speech tokenizer's decoder: codes [B, 16, T] (one semantic codebook, then
15 acoustic ones, 12.5 frames a second) -> audio [B, T * 1920] at 24 kHz, in [-1, 1].

    split RVQ: codebook 0 and the sum of codebooks 1..15, each through its 1x1 projection, added
    causal conv k3; pre-norm transformer (RoPE, sliding-window causal attention of
        `sliding_window` keys, SwiGLU MLP, LayerScale on both residual branches)
    per upsampling ratio (2, 2): causal transposed conv (kernel = stride), ConvNeXt block
    causal conv k7; per upsample rate r (8, 5, 4, 3; channels halve): SnakeBeta, causal transposed
        conv (kernel 2r, stride r), residual units of dilation 1, 3, 9 (SnakeBeta, k7, SnakeBeta, 1x1)
    SnakeBeta, causal conv k7 to one channel, clamp to [-1, 1]

Every layer is causal, so the decoder streams: each layer whose output reads earlier inputs (the
convs of kernel > 1, the transposed convs, each attention layer's last sliding_window - 1 keys
and values) carries them from one call to the next as the stream's history (`history_shapes`).
`step` decodes the new frames of R rows at once, each row at its own position; rows are padded
on the right, which changes no row's audio as nothing reads a later step. Chunk by chunk this
gives the whole-utterance audio (`forward`, the release's decoder forward) up to float rounding.
`decode` is the release's tokenizer decode: 300-frame chunks, each after 25 frames of context.

Parameter names follow the checkpoint's `decoder.*` tensors, except three that the loader
(codec_weights.py) builds: `quantizer.codebooks` (each codebook's embedding_sum / cluster_usage),
the fused attention `qkv_proj` and MLP `gate_up_proj`.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from mstar import ops
from mstar.models.qwen3_tts.codec_config import Qwen3TTSCodecConfig
from mstar.ops.snake_beta import snake_beta


class DecodeStep:
    """One decode call over R rows: new frames (`lengths`; later columns are padding) and frames
    decoded before (`positions`) per row, and each stateful layer's history, replaced by the
    history after the call as the layers run."""

    def __init__(self, lengths: torch.Tensor, positions: torch.Tensor, history: list[torch.Tensor]):
        self.lengths = lengths
        self.positions = positions
        self.history = list(history)

    def extend(self, layer: "_Stateful", x: torch.Tensor) -> torch.Tensor:
        """x preceded by the layer's history along its time dim; records each row's history after
        its valid inputs (its last `history_steps` inputs of this call and before)."""
        d, steps = layer.time_dim, layer.history_steps
        full = torch.cat([self.history[layer.history_index], x], dim=d)
        idx = (self.lengths * layer.rate)[:, None] + torch.arange(steps, device=x.device)  # [R, steps]
        idx = idx[:, None, :].expand(-1, full.shape[1], -1) if d == 2 else idx[:, :, None].expand(-1, -1, full.shape[2])
        self.history[layer.history_index] = full.gather(d, idx)
        return full


class _Stateful(nn.Module):
    """A causal layer whose output reads `history_steps` earlier inputs ([channels, steps], or
    [steps, channels] for time_dim 1); `rate` is its input's steps per codec frame."""
    time_dim, history_steps, channels, rate, history_index = 2, 0, 0, 1, -1

    def history_shape(self) -> tuple[int, int]:
        return (self.channels, self.history_steps) if self.time_dim == 2 else (self.history_steps, self.channels)


class _CausalConv(_Stateful):
    """Stride-1 conv whose output at t reads inputs t - (kernel - 1) * dilation .. t (the
    release left-pads with zeros: an empty history)."""

    def __init__(self, c_in: int, c_out: int, kernel: int, rate: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel, dilation=dilation, groups=groups)
        self.channels, self.history_steps, self.rate = c_in, (kernel - 1) * dilation, rate

    def forward(self, x: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        return self.conv(step.extend(self, x) if self.history_steps else x)


class _CausalTransposedConv(_Stateful):
    """Transposed conv cut to `stride` outputs per input: the outputs of input t read inputs
    t - (ceil(kernel / stride) - 1) .. t (the release trims kernel - stride samples on the right)."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, rate: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(c_in, c_out, kernel, stride=stride)
        self.channels, self.history_steps, self.rate = c_in, math.ceil(kernel / stride) - 1, rate

    def forward(self, x: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        n, h, s = x.shape[-1], self.history_steps, self.conv.stride[0]
        y = self.conv(step.extend(self, x) if h else x)
        return y[..., h * s:(h + n) * s]


class _SnakeBeta(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))  # log frequency
        self.beta = nn.Parameter(torch.zeros(channels))  # log magnitude

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return snake_beta(x, self.alpha, self.beta)


class _ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int, rate: int):
        super().__init__()
        self.act1 = _SnakeBeta(dim)
        self.conv1 = _CausalConv(dim, dim, 7, rate, dilation=dilation)
        self.act2 = _SnakeBeta(dim)
        self.conv2 = _CausalConv(dim, dim, 1, rate)

    def forward(self, x: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        return self.conv2(self.act2(self.conv1(self.act1(x), step)), step) + x


class _DecoderBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, upsample: int, rate: int):
        super().__init__()
        self.block = nn.ModuleList([_SnakeBeta(c_in), _CausalTransposedConv(c_in, c_out, 2 * upsample, upsample, rate)]
                                   + [_ResidualUnit(c_out, d, rate * upsample) for d in (1, 3, 9)])

    def forward(self, x: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        x = self.block[0](x)
        for layer in self.block[1:]:
            x = layer(x, step)
        return x


class _ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int, rate: int):
        super().__init__()
        self.dwconv = _CausalConv(dim, dim, 7, rate, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        b, c, t = x.shape
        h = self.dwconv(x, step).transpose(1, 2).reshape(b * t, c)
        h = ops.layer_norm(h, self.norm.weight, self.norm.bias, self.norm.eps)
        h = self.pwconv2(ops.gelu(self.pwconv1(h), "none")) * self.gamma
        return x + h.view(b, t, c).transpose(1, 2)


# --- the transformer (tokens flattened to [R * n, hidden]) -------------------------------------
class _RMSNorm(nn.RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, False)


class _LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), 0.01))


class _Attention(_Stateful):
    """Sliding-window causal self-attention with RoPE and GQA; its history is each row's last
    sliding_window - 1 keys and values ([steps, 2 * kv_heads * head_dim], keys first)."""
    time_dim = 1

    def __init__(self, cfg: Qwen3TTSCodecConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                            cfg.attention_head_dim)
        qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, qkv, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.channels, self.history_steps = 2 * self.num_kv_heads * self.head_dim, cfg.sliding_window - 1

    def forward(self, x: torch.Tensor, step: DecodeStep, rope: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor) -> torch.Tensor:
        rows, n = mask.shape[0], mask.shape[2]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv_proj(x).split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k = ops.rotary_embedding(rope[0], q.reshape(-1, hq, d), k.reshape(-1, hkv, d), rope[1], d)
        kv = torch.cat([k.reshape(rows, n, hkv * d), v.reshape(rows, n, hkv * d)], dim=-1)
        kv = step.extend(self, kv) if self.history_steps else kv  # [R, L, 2 * hkv * d]
        length = kv.shape[1]
        keys = kv[..., :hkv * d].view(rows, length, hkv, d).transpose(1, 2)
        values = kv[..., hkv * d:].view(rows, length, hkv, d).transpose(1, 2)
        # no mstar op takes a sliding window (dense_attention is causal or full), hence torch's SDPA
        o = F.scaled_dot_product_attention(q.view(rows, n, hq, d).transpose(1, 2), keys, values, attn_mask=mask,
                                           scale=d ** -0.5, enable_gqa=hq != hkv)
        return self.o_proj(o.transpose(1, 2).reshape(rows * n, hq * d))


class _MLP(nn.Module):
    def __init__(self, cfg: Qwen3TTSCodecConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class _TransformerLayer(nn.Module):
    def __init__(self, cfg: Qwen3TTSCodecConfig):
        super().__init__()
        self.input_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = _Attention(cfg)
        self.self_attn_layer_scale = _LayerScale(cfg.hidden_size)
        self.post_attention_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = _MLP(cfg)
        self.mlp_layer_scale = _LayerScale(cfg.hidden_size)

    def forward(self, x, step, rope, mask):
        x = x + self.self_attn_layer_scale.scale * self.self_attn(self.input_layernorm(x), step, rope, mask)
        return x + self.mlp_layer_scale.scale * self.mlp(self.post_attention_layernorm(x))


class _Transformer(nn.Module):
    def __init__(self, cfg: Qwen3TTSCodecConfig):
        super().__init__()
        self.window = cfg.sliding_window
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.layers = nn.ModuleList([_TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)
        d = cfg.attention_head_dim
        # float32 whatever the model's dtype (not a buffer, so .to(dtype) leaves it): RoPE angles
        self._inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))

    def _rope(self, positions: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary table of this call's tokens (row-major) and their indices into it: streams
        have no length bound, so the angles come from the positions, as the release computes them."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        pos = (positions[:, None] + torch.arange(n, device=positions.device)).reshape(-1, 1).float()
        freqs = pos * self._inv_freq[None, :]
        return torch.arange(pos.shape[0], device=pos.device), torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    def _mask(self, positions: torch.Tensor, n: int) -> torch.Tensor:
        """[R, 1, n, W - 1 + n]: query j sees keys j .. j + W - 1 of [history | new] (its own
        position and the W - 1 before it) that the row has (the history of a row at position p
        holds only its last p entries)."""
        hist = self.window - 1
        i = torch.arange(hist + n, device=positions.device)
        j = torch.arange(n, device=positions.device)[:, None]
        band = (i >= j) & (i <= j + hist)
        seen = i[None, :] >= (hist - positions)[:, None]
        return (band[None] & seen[:, None])[:, None]

    def forward(self, x: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        rows, n, _ = x.shape
        rope, mask = self._rope(step.positions, n), self._mask(step.positions, n)
        h = self.input_proj(x.reshape(rows * n, -1))
        for layer in self.layers:
            h = layer(h, step, rope, mask)
        return self.output_proj(self.norm(h)).view(rows, n, -1)


class _Quantizer(nn.Module):
    """Codes [R, Q, n] -> [R, codebook_dim, n]: codebook 0 through first_proj plus the sum of
    codebooks 1..Q-1 through rest_proj (the release's rvq_first / rvq_rest output projections)."""

    def __init__(self, cfg: Qwen3TTSCodecConfig):
        super().__init__()
        dim = cfg.codebook_dim // 2
        self.codebooks = nn.Parameter(torch.randn(cfg.num_quantizers, cfg.codebook_size, dim))
        self.first_proj = nn.Linear(dim, cfg.codebook_dim, bias=False)
        self.rest_proj = nn.Linear(dim, cfg.codebook_dim, bias=False)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        book = torch.arange(codes.shape[1], device=codes.device)[None, :, None]
        e = self.codebooks[book, codes]  # [R, Q, n, dim]; an out-of-range code raises
        return (self.first_proj(e[:, 0]) + self.rest_proj(e[:, 1:].sum(1))).transpose(1, 2)


class Qwen3TTSCodecDecoder(nn.Module):
    """codes [B, num_quantizers, T] -> audio (see the module docstring)."""

    def __init__(self, config: Qwen3TTSCodecConfig | dict):
        super().__init__()
        self.config = cfg = config if isinstance(config, Qwen3TTSCodecConfig) else Qwen3TTSCodecConfig.from_dict(config)
        latent = cfg.latent_dim
        self.quantizer = _Quantizer(cfg)
        self.pre_conv = _CausalConv(cfg.codebook_dim, latent, 3, rate=1)
        self.pre_transformer = _Transformer(cfg)
        rate, upsample = 1, []
        for f in cfg.upsampling_ratios:
            upsample.append(nn.ModuleList([_CausalTransposedConv(latent, latent, f, f, rate),
                                           _ConvNeXtBlock(latent, rate * f)]))
            rate *= f
        self.upsample = nn.ModuleList(upsample)
        layers: list[nn.Module] = [_CausalConv(latent, cfg.decoder_dim, 7, rate)]
        c = cfg.decoder_dim
        for r in cfg.upsample_rates:
            layers.append(_DecoderBlock(c, c // 2, r, rate))
            c, rate = c // 2, rate * r
        self.decoder = nn.ModuleList(layers + [_SnakeBeta(c), _CausalConv(c, 1, 7, rate)])
        self._stateful = [m for m in self.modules() if isinstance(m, _Stateful) and m.history_steps]
        for i, m in enumerate(self._stateful):
            m.history_index = i

    @property
    def samples_per_frame(self) -> int:
        return self.config.samples_per_frame

    @property
    def sampling_rate(self) -> int:
        return self.config.output_sample_rate

    @property
    def device(self) -> torch.device:
        return self.pre_conv.conv.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.pre_conv.conv.weight.dtype

    def history_shapes(self) -> list[tuple[int, int]]:
        """Per stateful layer, the shape of one row's history (what a stream carries)."""
        return [m.history_shape() for m in self._stateful]

    def empty_history(self, rows: int) -> list[torch.Tensor]:
        """The history of `rows` new streams (zeros: what the release's left padding reads)."""
        return [torch.zeros((rows, *s), dtype=self.dtype, device=self.device) for s in self.history_shapes()]

    @torch.inference_mode()
    def step(self, codes: torch.Tensor, lengths: torch.Tensor, positions: torch.Tensor,
             history: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Decode the next frames of R rows: codes [R, Q, n] (row r's first lengths[r] columns are
        its new frames, the rest padding), positions [R] (frames each row decoded before), history
        (per stateful layer [R, ...], as `empty_history` or a previous step returned) ->
        (audio [R, n * samples_per_frame], of which row r's first lengths[r] * samples_per_frame
        samples are its new audio; the history after this call). Inputs are not modified."""
        if codes.dim() != 3 or codes.shape[1] != self.config.num_quantizers:
            raise ValueError(f"Qwen3-TTS codec: codes must be [R, {self.config.num_quantizers}, n], "
                             f"got {tuple(codes.shape)}")
        dev = self.device
        if codes.shape[-1] == 0:
            return torch.zeros((codes.shape[0], 0), dtype=self.dtype, device=dev), list(history)
        st = DecodeStep(lengths.to(dev, torch.long), positions.to(dev, torch.long), history)
        x = self.pre_conv(self.quantizer(codes.to(dev, torch.long).clamp(min=0)), st)
        x = self.pre_transformer(x.transpose(1, 2), st).transpose(1, 2)
        for transposed_conv, convnext in self.upsample:
            x = convnext(transposed_conv(x, st), st)
        x = self.decoder[0](x, st)
        for block in self.decoder[1:-2]:
            x = block(x, st)
        x = self.decoder[-1](self.decoder[-2](x), st)
        return x[:, 0].clamp(-1.0, 1.0), st.history

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """Whole utterances: codes [B, Q, T] -> audio [B, T * samples_per_frame] (the release's
        decoder forward, channel dim dropped)."""
        b, _, t = codes.shape
        lengths = torch.full((b,), t, dtype=torch.long)
        return self.step(codes, lengths, torch.zeros_like(lengths), self.empty_history(b))[0]

    def decode(self, codes: torch.Tensor, chunk_frames: int = 300, left_context_frames: int = 25) -> list[torch.Tensor]:
        """The release's tokenizer decode: codes [B, Q, T], a row ending early padded with -1 ->
        each row's audio [frames * samples_per_frame]. T is cut into chunks of chunk_frames, each
        decoded afresh after left_context_frames frames of the codes before it (whose audio is
        dropped); up to chunk_frames frames this is `forward`."""
        frames = (codes[:, 0] > -1).sum(1).tolist()
        codes = codes.clamp(min=0)
        spf, total, start, parts = self.samples_per_frame, codes.shape[-1], 0, []
        while start < total:
            end = min(start + chunk_frames, total)
            context = min(left_context_frames, start)
            parts.append(self(codes[..., start - context:end])[:, context * spf:])
            start = end
        audio = torch.cat(parts, dim=-1)
        return [a[:f * spf] for a, f in zip(audio, frames)]
