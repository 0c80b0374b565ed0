"""The Wan2.x diffusion transformer (Wan2.2 TI2V-5B shape) on mstar's op layer: one denoising
forward, latents [B, C, F, H, W] + timesteps + text states -> the model's prediction [B, C_out, F, H, W].

The computation is diffusers' WanTransformer3DModel (transformer_wan.py) with its precisions:

    patch embedding   Conv3d with kernel = stride = patch_size, done as one GEMM over the patches;
                      tokens in (frame, row, column) order, S = f * h * w post-patch
    condition         timestep t -> sinusoid (freq_dim, cos half first, float32) -> time_embedder
                      (linear, SiLU, linear; float32 weights) = temb, cast to the model dtype ->
                      time_proj(SiLU(temb)) = 6 modulation vectors per timestep; text states ->
                      text_embedder (linear, GELU tanh, linear)
                      timestep [B]: one per row; [B, S]: one per token (Wan2.2 TI2V's "expanded
                      timesteps": the conditioning first frame at t = 0). The embedding runs once per
                      row ([B]) or per distinct timestep value ([B, S]) and is gathered per token
                      (the same numbers as running it per token, a few rows of GEMM instead of S)
    block (x N)       (shift, scale, gate, c_shift, c_scale, c_gate) = scale_shift_table + modulation,
                      float32;
                      x += gate * self_attn(LN(x) * (1 + scale) + shift)          (float32 residual)
                      x += cross_attn(LN_affine(x), text)                          (model dtype)
                      x += c_gate * ffn(LN(x) * (1 + c_scale) + c_shift)          (float32 residual)
                      LNs in float32, norm1 / norm3 without affine, norm2 with (cross_attn_norm);
                      the modulated LNs (and the output's) are ops.modulated_layer_norm, the gated
                      residuals ops.gated_residual: each gathers the token's rows of the [U, 6, dim]
                      table itself (one kernel on CUDA, no [B, S, dim] float32 temporaries);
                      attention: q, k RMSNorm over all heads together (width heads * head_dim), the
                      self-attention's q, k rotated by the 3-D rotary (norm and rotary in one
                      ops.rms_norm_rotary); FFN: linear, GELU tanh, linear (the first
                      two one ops.linear_gelu: on CUDA one GEMM with a GELU epilogue)
    float8 (to_fp8)   the blocks' linear layers but the text's keys / values in float8 e4m3
                      (models/layers/fp8.py): the self-attention's q, k, v quantize x once and the
                      FFN's GELU runs in the second projection's quantize kernel
    output            (shift, scale) = scale_shift_table + temb (float32); proj_out(LN(x) * (1 + scale)
                      + shift); unpatchify

The 3-D rotary splits head_dim into t / h / w parts (h = w = 2 * (head_dim // 6), t the rest),
each rotated by the token's frame / row / column index with the frequencies theta^(-2i/part)
(theta 1e4, angles in float64, cos / sin tables in float32), complex-number style on interleaved
pairs (x[2i], x[2i+1]) -- not the NeoX halves of mstar.ops.rotary_embedding.

Parameter names follow diffusers' except three renames (transformer_weights.py maps them):
attn{1,2}.to_out.0 -> attn{1,2}.to_out, ffn.net.0.proj -> ffn.proj_in, ffn.net.2 -> ffn.proj_out.
`to_dtype` casts like diffusers' loader: everything in the dtype except its _keep_in_fp32_modules
(time_embedder, the scale_shift_tables, norm2).

Attention runs through ops.dense_attention with the batch flattened into ragged rows (every row the
same length); the text of a batch has one length (diffusers pads UMT5 states to 512).

The text embedder and every block's cross-attention keys (normed) and values are a function of the
text alone: `text_kv` computes them once ([blocks, B, L, dim] each) and `forward_kv` runs a step on
them; `forward` is the two together (diffusers recomputes them at every step; the numbers are the
same).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mstar import ops
from mstar.models.layers.fp8 import Fp8Linear, project, to_fp8
from mstar.models.wan.transformer_config import WanTransformerConfig

ROPE_THETA = 10000.0
FP32_MODULES = ("time_embedder", "scale_shift_table", "norm2")  # diffusers' _keep_in_fp32_modules with params


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """[N] -> [N, dim] float32: (cos(t f_i), sin(t f_i)) with f_i = max_period^(-i / (dim // 2))."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half
    ang = t.float()[:, None] * torch.exp(exponent)[None, :]
    emb = torch.cat([torch.cos(ang), torch.sin(ang)], dim=-1)
    return F.pad(emb, (0, 1)) if dim % 2 else emb


def rope_tables(head_parts: tuple[int, int, int], max_len: int,
                theta: float = ROPE_THETA) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per axis (t, h, w): (cos, sin) [max_len, part // 2] float32, one angle per rotated pair."""
    pos = torch.arange(max_len, dtype=torch.float64)
    out = []
    for d in head_parts:
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = torch.outer(pos, inv)
        out.append((ang.cos().float(), ang.sin().float()))
    return out


class RMSNorm(nn.Module):
    """RMSNorm with a weight (diffusers' norm_q / norm_k: torch.nn.RMSNorm over heads * head_dim)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, False)


class LayerNorm(nn.Module):
    """Affine LayerNorm computed in float32 (diffusers' FP32LayerNorm with elementwise_affine)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """In x's dtype: the norm in float32 rounded once (ops.layer_norm reads x as it is, so no
        float32 copy of x is made and none of the output)."""
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


class MLP(nn.Module):
    """linear -> act -> linear (act "tanh": GELU tanh; "silu": SiLU)."""

    def __init__(self, dim_in: int, hidden: int, dim_out: int, act: str):
        super().__init__()
        self.linear_1 = nn.Linear(dim_in, hidden)
        self.linear_2 = nn.Linear(hidden, dim_out)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_1(x)
        h = ops.gelu(h, "tanh") if self.act == "tanh" else F.silu(h)
        return self.linear_2(h)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.proj_in = nn.Linear(dim, hidden)
        self.proj_out = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.proj_in, Fp8Linear):  # GELU in proj_out's input quantization
            return self.proj_out(self.proj_in(x), "gelu_tanh")
        return self.proj_out(ops.linear_gelu(x, self.proj_in.weight, self.proj_in.bias, "tanh"))


def _indptr(rows: int, length: int) -> torch.Tensor:
    return torch.arange(rows + 1, dtype=torch.int32) * length  # host tensor: the op reads it without a sync


class WanAttention(nn.Module):
    """Self-attention (context None; q, k rotated) or cross-attention to `context`, all heads of
    width dim // heads, q / k RMSNorm-ed over the full width before the head split."""

    def __init__(self, dim: int, heads: int, eps: float):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)
        self.norm_q = RMSNorm(dim, eps)
        self.norm_k = RMSNorm(dim, eps)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """rope: (cos, sin) [S, head_dim // 2] float32 for self-attention (context None)."""
        if context is not None:
            return self.attend(x, *self.context_kv(context))
        H = self.heads  # self-attention: norm and rotary in one pass
        q, k, v = project(x, self.to_q, self.to_k, self.to_v)
        q = ops.rms_norm_rotary(q, self.norm_q.weight, *rope, H, self.norm_q.eps)
        k = ops.rms_norm_rotary(k, self.norm_k.weight, *rope, H, self.norm_k.eps)
        return self.attend_projected(q, k, v)

    def context_kv(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cross-attention's keys (normed) and values of `context` [B, L, dim]: a function of the
        text alone, the same at every step of a request."""
        return self.norm_k(self.to_k(context)), self.to_v(context)

    def attend(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Cross-attention of x [B, S, dim] to the context's keys / values [B, L, dim] (context_kv)."""
        return self.attend_projected(self.norm_q(self.to_q(x)), k, v)

    def attend_projected(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, S, dim = q.shape
        L = k.shape[1]
        H, D = self.heads, self.head_dim
        o = ops.dense_attention(q.reshape(B * S, H, D), k.reshape(B * L, H, D), v.reshape(B * L, H, D),
                                _indptr(B, S), _indptr(B, L), 1.0 / math.sqrt(D), False)
        return self.to_out(o.view(B, S, dim))


class WanBlock(nn.Module):
    def __init__(self, config: WanTransformerConfig):
        super().__init__()
        dim, eps = config.dim, config.eps
        self.eps = float(eps)
        self.attn1 = WanAttention(dim, config.num_attention_heads, eps)
        self.attn2 = WanAttention(dim, config.num_attention_heads, eps)
        self.norm2 = LayerNorm(dim, eps) if config.cross_attn_norm else None
        self.ffn = FeedForward(dim, config.ffn_dim)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, dim) / dim ** 0.5)

    def forward(self, x: torch.Tensor, text_k: torch.Tensor, text_v: torch.Tensor, proj: torch.Tensor,
                inverse: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [B, S, dim]; text_k, text_v [B, L, dim] (attn2.context_kv of the text); proj [U, 6, dim]
        (time_proj per distinct timestep); inverse [B, S | 1] (each token's timestep, its row of the
        modulation table)."""
        mod = self.scale_shift_table.float() + proj.float()  # [U, 6, dim]: shift, scale, gate, c_*
        h = ops.modulated_layer_norm(x, mod[:, 0], mod[:, 1], inverse, self.eps)
        x = ops.gated_residual(x, self.attn1(h, None, rope), mod[:, 2], inverse)
        h = self.norm2(x) if self.norm2 is not None else x
        x = x + self.attn2.attend(h, text_k, text_v)
        h = ops.modulated_layer_norm(x, mod[:, 3], mod[:, 4], inverse, self.eps)
        return ops.gated_residual(x, self.ffn(h), mod[:, 5], inverse)


class ConditionEmbedder(nn.Module):
    def __init__(self, config: WanTransformerConfig):
        super().__init__()
        dim = config.dim
        self.freq_dim = config.freq_dim
        self.time_embedder = MLP(config.freq_dim, dim, dim, "silu")
        self.time_proj = nn.Linear(dim, 6 * dim)
        self.text_embedder = MLP(config.text_dim, dim, dim, "tanh")

    def time(self, t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """t [U] -> (temb [U, dim] in dtype, time_proj [U, 6, dim] in dtype)."""
        w = self.time_embedder.linear_1.weight
        temb = self.time_embedder(timestep_embedding(t, self.freq_dim).to(w.dtype)).to(dtype)
        return temb, self.time_proj(F.silu(temb)).unflatten(-1, (6, -1))


class WanTransformer(nn.Module):
    def __init__(self, config: WanTransformerConfig):
        super().__init__()
        config.check()
        self.config = config
        dim = config.dim
        self.patch_size = tuple(config.patch_size)
        self.patch_embedding = _PatchEmbedding(config.in_channels, dim, self.patch_size)
        self.condition_embedder = ConditionEmbedder(config)
        self.blocks = nn.ModuleList([WanBlock(config) for _ in range(config.num_layers)])
        self.proj_out = nn.Linear(dim, config.out_channels * math.prod(self.patch_size))
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, dim) / dim ** 0.5)
        self._rope: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._rope_grids: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def dtype(self) -> torch.dtype:
        return self.proj_out.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.proj_out.weight.device

    def to_dtype(self, dtype: torch.dtype) -> "WanTransformer":
        """Everything in dtype except time_embedder, the scale_shift_tables and norm2 (float32, as
        diffusers keeps them)."""
        self.to(dtype)
        for name, p in self.named_parameters():
            if any(part in name.split(".") for part in FP32_MODULES):
                p.data = p.data.float()
        return self

    # The blocks' linear layers that to_fp8 turns to float8: all but the cross-attention's key and
    # value projections, which run once a batch on the text (text_kv).
    FP8_LINEARS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out", "attn2.to_q", "attn2.to_out",
                   "ffn.proj_in", "ffn.proj_out")

    def to_fp8(self) -> "WanTransformer":
        """The blocks' FP8_LINEARS as Fp8Linear (float8 e4m3 weights, a scale per output row), after
        the model is on its device and dtype; the embedders and the output projection stay."""
        for block in self.blocks:
            to_fp8(block, self.FP8_LINEARS)
        return self

    def rope(self, f: int, h: int, w: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [f * h * w, head_dim // 2] float32 for the post-patch grid (made once per grid)."""
        got = self._rope_grids.get((f, h, w, device))
        if got is not None:
            return got
        tables = self._rope.get(device)
        if tables is None:
            tables = [(c.to(device), s.to(device)) for c, s in
                      rope_tables(self.config.rope_dims, self.config.rope_max_seq_len)]
            self._rope[device] = tables
        grid = (f, h, w)
        out = []
        for which in (0, 1):
            parts = []
            for axis, n in enumerate(grid):
                shape = [1, 1, 1, -1]
                shape[axis] = n
                parts.append(tables[axis][which][:n].view(shape).expand(f, h, w, -1))
            out.append(torch.cat(parts, dim=-1).reshape(f * h * w, -1))
        got = self._rope_grids[(f, h, w, device)] = (out[0], out[1])
        return got

    def _check(self, latents: torch.Tensor, timestep: torch.Tensor) -> tuple[int, ...]:
        c = self.config
        if latents.dim() != 5 or latents.shape[1] != c.in_channels:
            raise ValueError(f"wan transformer: latents must be [B, {c.in_channels}, F, H, W], got "
                             f"{tuple(latents.shape)}")
        B, _, Fr, H, W = latents.shape
        pt, ph, pw = self.patch_size
        if Fr % pt or H % ph or W % pw:
            raise ValueError(f"wan transformer: latent F, H, W {(Fr, H, W)} must be multiples of the patch "
                             f"{self.patch_size}")
        f, h, w = Fr // pt, H // ph, W // pw
        if max(f, h, w) > c.rope_max_seq_len:
            raise ValueError(f"wan transformer: post-patch grid {(f, h, w)} exceeds rope_max_seq_len "
                             f"{c.rope_max_seq_len}")
        if timestep.shape not in ((B,), (B, f * h * w)):
            raise ValueError(f"wan transformer: timestep must be [{B}] or [{B}, {f * h * w}] (one per token), "
                             f"got {tuple(timestep.shape)}")
        return B, f, h, w

    def _check_text(self, text_states: torch.Tensor, rows: int | None = None) -> None:
        if text_states.dim() != 3 or (rows is not None and text_states.shape[0] != rows) \
                or text_states.shape[2] != self.config.text_dim:
            raise ValueError(f"wan transformer: text_states must be [{rows if rows is not None else 'B'}, L, "
                             f"{self.config.text_dim}], got {tuple(text_states.shape)}")

    @torch.inference_mode()
    def text_kv(self, text_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """text_states [B, L, text_dim] -> every block's cross-attention keys and values of them,
        [blocks, B, L, dim] each: what a request's text contributes to every step, computed once."""
        return self._text_kv(text_states)

    def _text_kv(self, text_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # undecorated (the public methods' inference_mode is not traced by torch.compile)
        self._check_text(text_states)
        context = self.condition_embedder.text_embedder(text_states.to(self.dtype))
        ks, vs = zip(*(block.attn2.context_kv(context) for block in self.blocks))
        return torch.stack(ks), torch.stack(vs)

    @torch.inference_mode()
    def forward(self, latents: torch.Tensor, timestep: torch.Tensor, text_states: torch.Tensor) -> torch.Tensor:
        """latents [B, C, F, H, W]; timestep [B] or [B, S] (S = post-patch tokens, per token);
        text_states [B, L, text_dim] -> [B, C_out, F, H, W] in the model dtype."""
        self._check(latents, timestep)
        self._check_text(text_states, latents.shape[0])
        return self._forward_kv(latents, timestep, *self._text_kv(text_states))

    @torch.inference_mode()
    def forward_kv(self, latents: torch.Tensor, timestep: torch.Tensor, text_k: torch.Tensor,
                   text_v: torch.Tensor) -> torch.Tensor:
        """`forward` after text_kv: text_k, text_v [blocks, B, L, dim] (the same numbers)."""
        return self._forward_kv(latents, timestep, text_k, text_v)

    def _forward_kv(self, latents: torch.Tensor, timestep: torch.Tensor, text_k: torch.Tensor,
                    text_v: torch.Tensor) -> torch.Tensor:
        c = self.config
        if text_k.shape != text_v.shape or text_k.dim() != 4 or text_k.shape[0] != c.num_layers \
                or text_k.shape[1] != latents.shape[0] or text_k.shape[3] != c.dim:
            raise ValueError(f"wan transformer: text keys / values must be [{c.num_layers}, {latents.shape[0]}, L, "
                             f"{c.dim}], got {tuple(text_k.shape)} and {tuple(text_v.shape)}")
        B, f, h, w = self._check(latents, timestep)
        dt, dev = self.dtype, latents.device
        x = self.patch_embedding(latents.to(dt))  # [B, S, dim]
        rope = self.rope(f, h, w, dev)

        if timestep.dim() == 1:  # one per row: its own row of the tables (no unique: it would sync)
            uniq, inverse = timestep, torch.arange(B, device=dev)[:, None]
        else:  # per token: each distinct value once (a host sync; image-to-video only)
            uniq, inverse = torch.unique(timestep.reshape(-1), return_inverse=True)
            inverse = inverse.view(B, -1)  # [B, S]
        temb, proj = self.condition_embedder.time(uniq, dt)
        for i, block in enumerate(self.blocks):
            x = block(x, text_k[i], text_v[i], proj, inverse, rope)

        mod = self.scale_shift_table.float() + temb[:, None].float()  # [U, 2, dim]: shift, scale
        x = ops.modulated_layer_norm(x, mod[:, 0], mod[:, 1], inverse, self.config.eps)
        return self.unpatchify(self.proj_out(x), f, h, w)

    def unpatchify(self, x: torch.Tensor, f: int, h: int, w: int) -> torch.Tensor:
        """[B, S, C_out * pt * ph * pw] (channel innermost) -> [B, C_out, f * pt, h * ph, w * pw]."""
        pt, ph, pw = self.patch_size
        B = x.shape[0]
        y = x.view(B, f, h, w, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return y.reshape(B, -1, f * pt, h * ph, w * pw)


class _PatchEmbedding(nn.Module):
    """Conv3d with kernel = stride = patch (parameters as nn.Conv3d's: weight [dim, C, pt, ph, pw], bias
    [dim]), computed as a GEMM over the flattened patches: [B, C, F, H, W] -> [B, S, dim]."""

    def __init__(self, in_channels: int, dim: int, patch: tuple[int, int, int]):
        super().__init__()
        conv = nn.Conv3d(in_channels, dim, kernel_size=patch, stride=patch)
        self.weight, self.bias = conv.weight, conv.bias
        self.patch = patch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, Fr, H, W = x.shape
        pt, ph, pw = self.patch
        f, h, w = Fr // pt, H // ph, W // pw
        p = x.view(B, C, f, pt, h, ph, w, pw).permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(B, f * h * w, -1)
        return F.linear(p, self.weight.flatten(1), self.bias)
