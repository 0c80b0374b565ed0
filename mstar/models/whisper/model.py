"""Whisper (encoder-decoder ASR): what transformers' `WhisperForConditionalGeneration`
computes, on mstar.ops, driven by the runtime in two phases.

Encoder (once per request, on admission):
    log-mel [B, n_mels, 3000] -> conv1 (k3, pad 1) + GELU -> conv2 (k3, stride 2, pad 1) + GELU
    -> + positions (the checkpoint's sinusoid table, [1500, d]) -> pre-LN layers (non-causal
    self-attention through `ops.dense_attention`, GELU MLP) -> final LayerNorm [B, 1500, d].
    `encode(features, cross_slots)` also projects the output through every decoder layer's
    cross-attention k/v and stores it in the request's cross slot (context.py).
Decoder (every step, batched like an LLM step; the ForwardContext contract of context.py):
    token embedding + learned positions (max 448) -> pre-LN layers: causal self-attention
    with KV in pages (`paged_attention`), cross-attention over the request's cross slot
    (`ops.paged_attention_decode`, one row per token: every token sees the whole source),
    GELU MLP -> final LayerNorm -> logits = hidden @ embed_tokens^T (tied `proj_out`).

Attention scale head_dim^-0.5 is passed to the attention ops (transformers multiplies q
by it before a scale-1 attention: the same numbers, bit for bit, for Whisper's power-of-two
head_dim 64, and one elementwise op less per layer). Whisper's k_proj has no bias: we fuse q/k/v (and cross k/v) into one matmul whose
k rows of the bias are kept at zero (no checkpoint tensor fills them).

The runtime-facing API is DecoderLM's (base.py) plus:
    encode(input_features, cross_slots=None) -> encoder output [B, S, d]
    cache_spec().cross, ModelCaches.cross_k_caches / cross_v_caches, ForwardContext.cross
    max_source_positions, max_target_positions, num_mel_bins
`load_whisper(name_or_dir, ...)` loads a checkpoint directory or a Whisper preset
(presets.py) and insists that it is Whisper.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from mstar import ops
from mstar.models.base import DecoderLM, WeightLoadError, allocate_meta
from mstar.models.context import (AttentionLayerSpec, CacheSpec, CrossAttentionSpec, ForwardContext, cross_page_size,
                                  ModelCaches)
from mstar.models.layers import Embedding, FusedLinear, Linear, paged_attention, weight_map

log = logging.getLogger("mstar.models")

_GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's encoder position table [length, channels]: sin | cos halves, geometric
    timescales from 1 to max_timescale (float32)."""
    if channels % 2:
        raise ValueError(f"sinusoidal positions need an even width, got {channels}")
    half = channels // 2
    inc = math.log(max_timescale) / (half - 1)
    inv = torch.exp(-inc * torch.arange(half, dtype=torch.float32))
    t = torch.arange(length, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([t.sin(), t.cos()], dim=1)


# --- building blocks --------------------------------------------------------------------------
class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim))
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm(x, self.weight, self.bias, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); residual None: (norm(x), x)."""
        if residual is None:
            return self.forward(x), x
        return ops.fused_add_layer_norm(x, residual, self.weight, self.bias, self.eps)


class Conv1d(nn.Module):
    """nn.Conv1d's parameters (checkpoint names weight / bias), computed with F.conv1d."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, padding: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cout, cin, kernel))
        self.bias = nn.Parameter(torch.empty(cout))
        self.stride, self.padding = stride, padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv1d(x, self.weight, self.bias, stride=self.stride, padding=self.padding)


class _FFN:
    """fc1 -> GELU -> fc2 (mixed into the layer classes: the checkpoint keeps fc1 / fc2 on the layer)."""

    def _ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(ops.gelu(self.fc1(x), self.gelu_approx))


def _split_qkv(qkv: torch.Tensor, heads: int, head_dim: int, kv_views: bool = False):
    """q, k, v [T, H, D] from the fused projection. kv_views: k and v stay views of `qkv` (their
    rows strided): kv_append reads rows at any stride, and two copies per layer go."""
    t, d = qkv.shape[0], heads * head_dim
    q = qkv[:, :d].contiguous().view(t, heads, head_dim)
    k, v = qkv[:, d:2 * d], qkv[:, 2 * d:]
    if not kv_views:
        k, v = k.contiguous(), v.contiguous()
    return q, k.view(t, heads, head_dim), v.view(t, heads, head_dim)


class EncoderAttention(nn.Module):
    """Non-causal self-attention over each clip's frames (ragged rows, `ops.dense_attention`)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.num_heads, self.head_dim = heads, d // heads
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = FusedLinear(d, ("q_proj", "k_proj", "v_proj"), (d, d, d), bias=True)
        self.out_proj = Linear(d, d, bias=True)

    def forward(self, x: torch.Tensor, indptr: torch.Tensor) -> torch.Tensor:
        q, k, v = _split_qkv(self.qkv_proj(x), self.num_heads, self.head_dim)
        o = ops.dense_attention(q, k, v, indptr, indptr, self.scale, False)
        return self.out_proj(o.reshape(x.shape[0], -1))


class EncoderLayer(nn.Module, _FFN):
    def __init__(self, d: int, heads: int, ffn: int, gelu_approx: str):
        super().__init__()
        self.self_attn = EncoderAttention(d, heads)
        self.self_attn_layer_norm = LayerNorm(d)
        self.fc1 = Linear(d, ffn, bias=True)
        self.fc2 = Linear(ffn, d, bias=True)
        self.final_layer_norm = LayerNorm(d)
        self.gelu_approx = gelu_approx

    def forward(self, h, residual, indptr):
        x, residual = self.self_attn_layer_norm.add_forward(h, residual)
        h = self.self_attn(x, indptr)
        x, residual = self.final_layer_norm.add_forward(h, residual)
        return self._ffn(x), residual


class WhisperEncoder(nn.Module):
    def __init__(self, c, gelu_approx: str):
        super().__init__()
        d = c.d_model
        self.num_mel_bins = c.num_mel_bins
        self.max_source_positions = c.max_source_positions
        self.conv1 = Conv1d(c.num_mel_bins, d, 3, 1, 1)
        self.conv2 = Conv1d(d, d, 3, 2, 1)
        self.embed_positions = Embedding(c.max_source_positions, d)
        self.layers = nn.ModuleList(EncoderLayer(d, c.encoder_attention_heads, c.encoder_ffn_dim, gelu_approx)
                                    for _ in range(c.encoder_layers))
        self.layer_norm = LayerNorm(d)
        self.gelu_approx = gelu_approx

    @property
    def num_frames(self) -> int:
        """Mel frames one clip must have (conv2 halves them): 3000 for Whisper."""
        return self.max_source_positions * 2

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[B, n_mels, 3000] -> [B, 1500, d]."""
        if features.dim() != 3 or features.shape[1] != self.num_mel_bins or features.shape[2] != self.num_frames:
            raise ValueError(f"Whisper encoder wants log-mel features [B, {self.num_mel_bins}, {self.num_frames}] "
                             f"(30 s, padded), got {tuple(features.shape)}")
        w = self.conv1.weight
        x = ops.gelu(self.conv1(features.to(device=w.device, dtype=w.dtype)), self.gelu_approx)
        x = ops.gelu(self.conv2(x), self.gelu_approx)  # [B, d, S]
        b, d, s = x.shape
        h = (x.transpose(1, 2) + self.embed_positions.weight[:s]).reshape(b * s, d)
        indptr = torch.arange(0, (b + 1) * s, s, dtype=torch.int32)  # host: no device sync to plan
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, indptr)
        out, _ = self.layer_norm.add_forward(h, residual)
        return out.view(b, s, d)


class DecoderSelfAttention(nn.Module):
    """Causal self-attention with KV in pages (the LLM path)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.num_heads = self.num_kv_heads = heads
        self.head_dim = d // heads
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = FusedLinear(d, ("q_proj", "k_proj", "v_proj"), (d, d, d), bias=True)
        self.out_proj = Linear(d, d, bias=True)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def spec(self) -> AttentionLayerSpec:
        return AttentionLayerSpec(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, num_q_heads=self.num_heads,
                                  scale=self.scale)

    def forward(self, ctx: ForwardContext, x: torch.Tensor) -> torch.Tensor:
        q, k, v = _split_qkv(self.qkv_proj(x), self.num_heads, self.head_dim, kv_views=True)
        o = paged_attention(ctx, q, k, v, self.k_cache, self.v_cache, self.scale)
        return self.out_proj(o.reshape(x.shape[0], -1))


class CrossAttention(nn.Module):
    """Attention of decoder tokens over their request's encoder output, whose K/V were
    written once into a cross slot by `write_kv`."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.num_heads = self.num_kv_heads = heads
        self.head_dim = d // heads
        self.scale = self.head_dim ** -0.5
        self.q_proj = Linear(d, d, bias=True)
        self.kv_proj = FusedLinear(d, ("k_proj", "v_proj"), (d, d), bias=True)
        self.out_proj = Linear(d, d, bias=True)
        self.k_cache: torch.Tensor | None = None  # [num_cross_slots, max_source_len, H, D]
        self.v_cache: torch.Tensor | None = None
        self.k_pages: torch.Tensor | None = None  # the same memory as pages (context.cross_page_size)
        self.v_pages: torch.Tensor | None = None

    def spec(self) -> AttentionLayerSpec:
        return AttentionLayerSpec(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, num_q_heads=self.num_heads,
                                  scale=self.scale)

    def write_kv(self, enc: torch.Tensor, slots: torch.Tensor) -> None:
        """enc [B, S, d] -> cross slots `slots` [B] (positions 0..S-1)."""
        b, s, d = enc.shape
        kv = self.kv_proj(enc.reshape(b * s, d))
        k = kv[:, :d].reshape(b, s, self.num_heads, self.head_dim)
        v = kv[:, d:].reshape(b, s, self.num_heads, self.head_dim)
        if s == self.k_cache.shape[1]:
            self.k_cache.index_copy_(0, slots, k.to(self.k_cache.dtype))
            self.v_cache.index_copy_(0, slots, v.to(self.v_cache.dtype))
        else:
            self.k_cache[slots, :s] = k.to(self.k_cache.dtype)
            self.v_cache[slots, :s] = v.to(self.v_cache.dtype)

    def forward(self, ctx: ForwardContext, x: torch.Tensor) -> torch.Tensor:
        md = ctx.cross
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        o = ops.paged_attention_decode(q, self.k_pages, self.v_pages, md.kv_indptr, md.kv_indices,
                                       md.kv_last_page_len, self.scale)
        return self.out_proj(o.reshape(t, -1))


class DecoderLayer(nn.Module, _FFN):
    def __init__(self, d: int, heads: int, ffn: int, gelu_approx: str):
        super().__init__()
        self.self_attn = DecoderSelfAttention(d, heads)
        self.self_attn_layer_norm = LayerNorm(d)
        self.encoder_attn = CrossAttention(d, heads)
        self.encoder_attn_layer_norm = LayerNorm(d)
        self.fc1 = Linear(d, ffn, bias=True)
        self.fc2 = Linear(ffn, d, bias=True)
        self.final_layer_norm = LayerNorm(d)
        self.gelu_approx = gelu_approx

    def forward(self, ctx, h, residual):
        x, residual = self.self_attn_layer_norm.add_forward(h, residual)
        h = self.self_attn(ctx, x)
        x, residual = self.encoder_attn_layer_norm.add_forward(h, residual)
        h = self.encoder_attn(ctx, x)
        x, residual = self.final_layer_norm.add_forward(h, residual)
        return self._ffn(x), residual


class WhisperDecoder(nn.Module):
    def __init__(self, c, gelu_approx: str):
        super().__init__()
        d = c.d_model
        self.embed_tokens = Embedding(c.vocab_size, d)
        self.embed_positions = Embedding(c.max_target_positions, d)
        self.layers = nn.ModuleList(DecoderLayer(d, c.decoder_attention_heads, c.decoder_ffn_dim, gelu_approx)
                                    for _ in range(c.decoder_layers))
        self.layer_norm = LayerNorm(d)


class WhisperModel(nn.Module):
    """Holds what checkpoints call `model.*`: encoder and decoder."""

    def __init__(self, c, gelu_approx: str):
        super().__init__()
        self.encoder = WhisperEncoder(c, gelu_approx)
        self.decoder = WhisperDecoder(c, gelu_approx)


# --- the model --------------------------------------------------------------------------------
class WhisperForConditionalGeneration(DecoderLM):
    _PREFIX_REWRITES = ()
    _VISION_PREFIXES = ()

    def __init__(self, config):
        super().__init__(config)
        c = config
        act = getattr(c, "activation_function", "gelu")
        if act not in _GELU:
            raise ValueError(f"Whisper activation {act!r} is not supported ({', '.join(_GELU)})")
        if getattr(c, "scale_embedding", False):
            raise ValueError("Whisper with scale_embedding=True is not supported (no released checkpoint uses it)")
        if c.d_model % c.encoder_attention_heads or c.d_model % c.decoder_attention_heads:
            raise ValueError("d_model must be a multiple of the attention head counts")
        self.num_mel_bins = int(c.num_mel_bins)
        self.max_source_positions = int(c.max_source_positions)
        self.max_target_positions = int(c.max_target_positions)
        self.model = WhisperModel(c, _GELU[act])
        if not self.tie_word_embeddings:
            self.proj_out = Linear(c.d_model, c.vocab_size)

    # --- properties -------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.model.decoder.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.decoder.embed_tokens.weight.device

    @property
    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.model.decoder.layers]

    @property
    def cross_attention_layers(self) -> list[nn.Module]:
        return [layer.encoder_attn for layer in self.model.decoder.layers]

    @property
    def state_layers(self) -> list[nn.Module]:
        return []

    # --- caches -----------------------------------------------------------------------------
    def memory_specs(self) -> list:
        return [m.spec() for m in self.attention_layers] + [
            CrossAttentionSpec(layers=tuple(m.spec() for m in self.cross_attention_layers),
                               max_source_len=self.max_source_positions)]

    def cache_spec(self) -> CacheSpec:
        return CacheSpec.from_specs(self.memory_specs())

    def bind_caches(self, caches: ModelCaches) -> None:
        cross = self.cross_attention_layers
        if len(caches.cross_k_caches) != len(cross) or len(caches.cross_v_caches) != len(cross):
            raise ValueError(f"bind_caches: Whisper has {len(cross)} cross-attention layers, got "
                             f"{len(caches.cross_k_caches)} cross k and {len(caches.cross_v_caches)} cross v "
                             f"pools (allocate CacheSpec.cross: [slots, {self.max_source_positions}, H, D])")
        for i, (m, k, v) in enumerate(zip(cross, caches.cross_k_caches, caches.cross_v_caches)):
            if k.dim() != 4 or k.shape[1:] != (self.max_source_positions, m.num_kv_heads, m.head_dim) \
                    or v.shape != k.shape:
                raise ValueError(f"bind_caches: cross-attention layer {i} wants [slots, {self.max_source_positions}, "
                                 f"{m.num_kv_heads}, {m.head_dim}], got k {tuple(k.shape)} v {tuple(v.shape)}")
        self._bind_paged_kv(caches)
        page = cross_page_size(self.max_source_positions)
        for m, k, v in zip(cross, caches.cross_k_caches, caches.cross_v_caches):
            m.k_cache, m.v_cache = k, v
            # the pages cross-attention reads (CrossAttentionMetadata): a view, no copy
            m.k_pages = k.view(-1, page, m.num_kv_heads, m.head_dim)
            m.v_pages = v.view(-1, page, m.num_kv_heads, m.head_dim)
        self._caches_bound = True

    # --- encoder ----------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, input_features: torch.Tensor, cross_slots: torch.Tensor | None = None) -> torch.Tensor:
        """Run the encoder on log-mel features [B, n_mels, 3000] -> [B, 1500, d]; with
        cross_slots ([B] ints), also write every decoder layer's cross K/V of clip b into
        cross slot cross_slots[b] (the request's; needs bind_caches)."""
        enc = self.model.encoder(input_features)
        if cross_slots is not None:
            if not self._caches_bound:
                raise RuntimeError("bind_caches() must be called before encode(..., cross_slots)")
            slots = torch.as_tensor(cross_slots, device=enc.device).long().view(-1)
            if slots.numel() != enc.shape[0]:
                raise ValueError(f"encode: {enc.shape[0]} clips but {slots.numel()} cross slots")
            for m in self.cross_attention_layers:
                m.write_kv(enc, slots)
        return enc

    # --- decoder ----------------------------------------------------------------------------
    def forward(self, ctx: ForwardContext) -> torch.Tensor:
        """One decoder step (context.py): [T, d] hidden states after the final LayerNorm."""
        if not self._caches_bound:
            raise RuntimeError("bind_caches() must be called before the first forward")
        if ctx.cross is None and ctx.num_tokens > 0:
            raise ValueError("Whisper decoder steps need ForwardContext.cross (each token's cross slot)")
        dec = self.model.decoder
        h = dec.embed_tokens(ctx.input_ids) + F.embedding(ctx.positions, dec.embed_positions.weight)
        residual = None
        for layer in dec.layers:
            h, residual = layer(ctx, h, residual)
        out, _ = dec.layer_norm.add_forward(h, residual)
        return out

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.decoder.embed_tokens.weight if self.tie_word_embeddings else self.proj_out.weight

    # --- weights ----------------------------------------------------------------------------
    def _fused_k_bias_slots(self) -> list[torch.Tensor]:
        """The k rows of fused biases (Whisper's k_proj has no bias: kept at zero)."""
        out = []
        for mod in self.modules():
            if isinstance(mod, FusedLinear) and mod.bias is not None and "k_proj" in mod.shard_names:
                i = mod.shard_names.index("k_proj")
                off = sum(mod.shard_sizes[:i])
                out.append(mod.bias.narrow(0, off, mod.shard_sizes[i]))
        return out

    def _zero_k_bias(self) -> None:
        with torch.no_grad():
            for b in self._fused_k_bias_slots():
                b.zero_()

    def expected_weights(self) -> dict:
        if self._weight_map is None:
            self._weight_map = {k: v for k, v in weight_map(self).items() if not k.endswith("k_proj.bias")}
        return self._weight_map

    def checkpoint_name(self, name: str) -> str:
        if name == "proj_out.weight" and self.tie_word_embeddings:
            return "lm_head.weight"  # the tied head: skipped by the loader
        return name

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        self._zero_k_bias()
        return super().load_weights(named_tensors)

    # --- init -------------------------------------------------------------------------------
    def materialize(self, device: torch.device | str) -> None:
        allocate_meta(self, device)
        self._weight_map = None

    def _init_param(self, name, p, module, std, gen) -> None:
        if isinstance(module, LayerNorm):
            p.fill_(1.0 if name == "weight" else 0.0)
        else:
            super()._init_param(name, p, module, std, gen)

    def init_random(self, seed: int = 0, std: float | None = None) -> None:
        std = std if std is not None else float(getattr(self.config, "init_std", 0.02))
        super().init_random(seed, std)
        with torch.no_grad():
            pos = self.model.encoder.embed_positions.weight
            pos.copy_(sinusoids(*pos.shape).to(pos.dtype))
        self._zero_k_bias()

    def num_parameters(self) -> int:
        """Checkpoint parameters (from shapes; works on meta): the k rows of the fused
        biases, which no checkpoint tensor fills, are not counted."""
        total = sum(math.prod(p.shape) for p in self.parameters())
        return total - sum(b.numel() for b in self._fused_k_bias_slots())


# --- loading ------------------------------------------------------------------------------------
def _with_max_positions(cfg):
    """The runtime sizes contexts from `max_position_embeddings`: for Whisper that is the
    decoder's max_target_positions (448)."""
    if getattr(cfg, "max_position_embeddings", None) is None:
        cfg.max_position_embeddings = int(cfg.max_target_positions)
    return cfg


def whisper_config_from_dir(path: str):
    """WhisperConfig of a checkpoint directory (eos from generation_config.json if there)."""
    import json

    from transformers import WhisperConfig
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path!r} has no config.json")
    with open(cfg_path) as f:
        raw = json.load(f)
    if raw.get("model_type") != "whisper":
        raise ValueError(f"{cfg_path}: model_type {raw.get('model_type')!r} is not 'whisper'")
    raw.pop("architectures", None)
    cfg = WhisperConfig.from_dict(raw)
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            gen = json.load(f)
        if gen.get("eos_token_id") is not None:
            cfg.eos_token_id = gen["eos_token_id"]
    return _with_max_positions(cfg)


def build_whisper(config, *, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "meta") -> WhisperForConditionalGeneration:
    """`mstar.models.build_model` for a Whisper config (kept for its explicit name)."""
    from mstar.models.loader import build_model
    return build_model(config, dtype=dtype, device=device)


def load_whisper(name_or_dir: str, **kwargs) -> WhisperForConditionalGeneration:
    """`mstar.models.load_model` that insists on a Whisper checkpoint or preset."""
    from mstar.models.loader import load_model
    model = load_model(name_or_dir, **kwargs)
    if not isinstance(model, WhisperForConditionalGeneration):
        raise ValueError(f"{name_or_dir!r} is not a Whisper model ({type(model).__name__})")
    return model


__all__ = ["WhisperForConditionalGeneration", "WeightLoadError", "build_whisper", "load_whisper",
           "whisper_config_from_dir", "sinusoids"]
