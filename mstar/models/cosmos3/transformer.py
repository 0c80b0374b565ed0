"""The Cosmos3 omni transformer (Cosmos3-Edge shape) on mstar's op layer: two towers of the same
shape over one sequence [prompt ; vision], split into the two computations they are.

    understanding tower  the prompt's tokens, causal: token embeddings through every layer's
                         input_layernorm, to_q / to_k / to_v (GQA), the rotary, causal attention,
                         to_out, post_attention_layernorm, mlp (each residual add in the kernel
                         of the norm after it). It never reads the vision tokens,
                         so its keys and values are a function of the prompt alone: `understand`
                         runs it once per prompt and keeps, per layer, the keys the generation
                         tower reads (k_norm_und_for_gen(k) when the config has it, rotated) and
                         the values: an UnderstandingKV. The last layer stops at its K/V (its
                         attention output and MLP feed nothing the generation tower reads), and the
                         tower's final norm and lm_head (text generation) are not run.
    generation tower     the vision tokens, non-causal: every step `generate` embeds the noisy
                         latents (p x p patches -> proj_in, plus the timestep embedding), then per
                         layer input_layernorm_moe_gen, add_q_proj / add_k_proj / add_v_proj,
                         norm_added_q / norm_added_k, the rotary, attention of the vision queries
                         to [the prompt's cached K/V ; the vision K/V], to_add_out,
                         post_attention_layernorm_moe_gen, mlp_moe_gen; norm_moe_gen, proj_out,
                         un-patchify: the velocity.

This is diffusers' Cosmos3OmniTransformer (transformer_cosmos3.py, 0.42) with hidden_act
"relu2", whose forward runs both towers over the whole sequence at every step; the numbers are the
same (the understanding tower's are identical: its inputs do not change). Precisions as there:
the Nemotron RMSNorms in float32, weight multiplied in float32, rounded once; the MLP
down(relu(up(x)) ** 2); the timestep t (integer) scaled by timestep_scale in float32, its 256-wide
sinusoid (cos half first) through time_embedder (float32 weights, diffusers'
_keep_in_fp32_modules), cast to the model dtype and added to every vision token. Attention scale
1 / sqrt(head_dim). The rotary tables come from rope.py; rotation is ops.rotary_embedding (NeoX
halves, float32, rounded once; diffusers rotates in the model dtype: the same in float32). The
norms are ops.rms_norm_fp32_weight, and in the generation tower each residual add with the norm
after it one ops.fused_add_rms_norm_fp32_weight (a layer hands its MLP output to the next layer's
first norm); the MLP's relu^2 is ops.relu_square: on CUDA one kernel each. A built model's
generation q / k / v projections are one matrix (fuse_projections): one GEMM, then one
ops.qk_norm_rope_kv_fp32_weight: q normed and rotated, and k (normed, rotated) and v written
straight into their rows of the joint keys and values the attention reads (JointKV: each row's
cached prompt K/V followed by its vision tokens' rows), so a step never copies the prompt's K/V.
`to_fp8` turns the generation tower's linear layers to float8 e4m3 (models/layers/fp8.py; the MLP's
relu^2 then runs in down_proj's input quantization).

Batches: `understand` takes any number of prompts (ragged rows, one causal attention call);
`generate` takes R rows of one grid, each with its own latents row, timestep, cached prompt K/V
(any length) and rotary table (the vision positions depend on the prompt's length);
`generate_rows` is the same forward over a JointKV built once for a batch (JointKV.of).
Parameter names are diffusers' (no renames).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mstar import ops
from mstar.models.cosmos3.config import Cosmos3TransformerConfig
from mstar.models.host_copy import to_device
from mstar.models.layers.fp8 import Fp8Linear, to_fp8
from mstar.models.wan.transformer import timestep_embedding

TIME_FREQ_DIM = 256  # diffusers' Timesteps(num_channels=256, flip_sin_to_cos=True)
FP32_MODULES = ("time_embedder",)  # diffusers' _keep_in_fp32_modules


@dataclass
class UnderstandingKV:
    """A prompt's keys and values as the generation tower reads them: k, v [layers, L, kv_heads,
    head_dim] in the model dtype (keys rotated), and the prompt's token count L."""
    k: torch.Tensor
    v: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.k.shape[1])


class NemotronRMSNorm(nn.Module):
    """RMSNorm in float32 with the weight multiplied in float32, rounded once (Nemotron's form):
    ops.rms_norm_fp32_weight, one kernel on CUDA."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm_fp32_weight(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward(x + y), x + y): the residual add and the norm after it, one kernel on CUDA."""
        return ops.fused_add_rms_norm_fp32_weight(x, y, self.weight, self.eps)


class ReLU2MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.down_proj, Fp8Linear):  # relu^2 in down_proj's input quantization
            return self.down_proj(self.up_proj(x), "relu_square")
        return self.down_proj(ops.relu_square(self.up_proj(x)))


class TimestepMLP(nn.Module):
    """linear_1 -> SiLU -> linear_2 (diffusers' TimestepEmbedding)."""

    def __init__(self, dim_in: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(dim_in, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


def _indptr(lengths: list[int]) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=torch.int32)  # a host tensor: the op reads it without a sync


def _rotate(table: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, Hq, D], k [N, Hk, D] rotated by the table's row n for token n."""
    pos = torch.arange(q.shape[0], device=q.device)
    return ops.rotary_embedding(pos, q, k, table, head_dim)


class Cosmos3Attention(nn.Module):
    """Both towers' projections and norms of one layer (diffusers' Cosmos3PackedMoTAttention)."""

    def __init__(self, config: Cosmos3TransformerConfig):
        super().__init__()
        c = config
        d, hq, hkv, bias = c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.attention_bias
        self.heads, self.kv_heads, self.head_dim = hq, hkv, d
        self.to_q = nn.Linear(c.hidden_size, hq * d, bias=bias)
        self.to_k = nn.Linear(c.hidden_size, hkv * d, bias=bias)
        self.to_v = nn.Linear(c.hidden_size, hkv * d, bias=bias)
        self.to_out = nn.Linear(hq * d, c.hidden_size, bias=bias)
        self.norm_q = NemotronRMSNorm(d, c.rms_norm_eps) if c.qk_norm_for_text else None
        self.norm_k = NemotronRMSNorm(d, c.rms_norm_eps) if c.qk_norm_for_text else None
        self.k_norm_und_for_gen = NemotronRMSNorm(d, c.rms_norm_eps) if c.k_norm_for_gen else None
        self.add_q_proj = nn.Linear(c.hidden_size, hq * d, bias=bias)
        self.add_k_proj = nn.Linear(c.hidden_size, hkv * d, bias=bias)
        self.add_v_proj = nn.Linear(c.hidden_size, hkv * d, bias=bias)
        self.to_add_out = nn.Linear(hq * d, c.hidden_size, bias=bias)
        self.norm_added_q = NemotronRMSNorm(d, c.rms_norm_eps)
        self.norm_added_k = NemotronRMSNorm(d, c.rms_norm_eps)
        self.scale = 1.0 / math.sqrt(d)
        self._gen_qkv: tuple | None = None  # (weight, bias) of add_q / k / v_proj as one matrix
        self.gen_qkv_fp8: Fp8Linear | None = None  # that matrix in float8 (generation_to_fp8)

    def fuse_generation_qkv(self) -> None:
        """add_q_proj, add_k_proj and add_v_proj as the rows of one weight (their parameters become
        views of it: names and state dict stay diffusers'), so the generation tower's q, k, v come
        from one GEMM and its head norms and rotary from one op. Moving or loading the module
        afterwards undoes it (the three projections again)."""
        mods = (self.add_q_proj, self.add_k_proj, self.add_v_proj)
        rows = [m.weight.shape[0] for m in mods]
        with torch.no_grad():
            w = torch.cat([m.weight for m in mods])
            b = torch.cat([m.bias for m in mods]) if mods[0].bias is not None else None
        for i, (m, part) in enumerate(zip(mods, w.split(rows))):
            m.weight = nn.Parameter(part, requires_grad=False)
            if b is not None:
                m.bias = nn.Parameter(b.split(rows)[i], requires_grad=False)
        self._gen_qkv = (w, b)

    def generation_to_fp8(self) -> None:
        """The generation tower's projections in float8 e4m3 (Fp8Linear): q / k / v as one matrix
        (add_q / k / v_proj are dropped) and to_add_out. The understanding tower's stay (it runs
        once a request)."""
        if self._gen_qkv is None:
            self.fuse_generation_qkv()
        self.gen_qkv_fp8 = Fp8Linear(*self._gen_qkv)
        # the bf16 projections go with their fused matrix: no step reads them any more
        self._gen_qkv = self.add_q_proj = self.add_k_proj = self.add_v_proj = None
        to_fp8(self, ("to_add_out",))

    def _apply(self, fn, recurse=True):
        self._gen_qkv = None  # the parameters get storage of their own: no longer views of the fused weight
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self._gen_qkv = None
        return super()._load_from_state_dict(*args, **kwargs)

    def understanding_qkv(self, h: torch.Tensor, table: torch.Tensor):
        """h [N, hidden] (normed) -> (q, k, k_for_gen, v): q and k rotated for the causal attention,
        k_for_gen the keys the generation tower reads (normed when configured, rotated)."""
        n, hq, hkv, d = h.shape[0], self.heads, self.kv_heads, self.head_dim
        q = self.to_q(h).view(n, hq, d)
        k = self.to_k(h).view(n, hkv, d)
        v = self.to_v(h).view(n, hkv, d)
        if self.norm_q is not None:
            q, k = self.norm_q(q), self.norm_k(k)
        kg = self.k_norm_und_for_gen(k) if self.k_norm_und_for_gen is not None else k
        qkg, k = _rotate(table, torch.cat([q, kg], dim=1), k, d)  # one rotation of q and k_for_gen
        return qkg[:, :hq], k, qkg[:, hq:], v

    def generation_q(self, h: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, joint_k: torch.Tensor,
                     joint_v: torch.Tensor, kv_rows: torch.Tensor) -> torch.Tensor:
        """h [N, hidden] (normed) -> q [N, Hq, D] of the vision tokens, normed and rotated (token n at
        table row positions[n]); their keys (normed, rotated) and values go into rows kv_rows of
        joint_k / joint_v [*, Hkv, D]."""
        n, hq, hkv, d = h.shape[0], self.heads, self.kv_heads, self.head_dim
        if self.gen_qkv_fp8 is not None or self._gen_qkv is not None:  # one GEMM, one kernel for the heads
            qkv = self.gen_qkv_fp8(h) if self.gen_qkv_fp8 is not None else F.linear(h, *self._gen_qkv)
            return ops.qk_norm_rope_kv_fp32_weight(qkv, positions, self.norm_added_q.weight,
                                                   self.norm_added_k.weight, table, hq, hkv, d, d,
                                                   self.norm_added_q.eps, joint_k, joint_v, kv_rows)
        q = self.norm_added_q(self.add_q_proj(h).view(n, hq, d))
        k = self.norm_added_k(self.add_k_proj(h).view(n, hkv, d))
        q, k = ops.rotary_embedding(positions, q, k, table, d)
        joint_k.index_copy_(0, kv_rows, k)
        joint_v.index_copy_(0, kv_rows, self.add_v_proj(h).view(n, hkv, d))
        return q


class Cosmos3Layer(nn.Module):
    def __init__(self, config: Cosmos3TransformerConfig):
        super().__init__()
        c = config
        self.self_attn = Cosmos3Attention(c)
        self.mlp = ReLU2MLP(c.hidden_size, c.intermediate_size)
        self.mlp_moe_gen = ReLU2MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = NemotronRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm_moe_gen = NemotronRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = NemotronRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm_moe_gen = NemotronRMSNorm(c.hidden_size, c.rms_norm_eps)

    def understand(self, x: torch.Tensor, mlp_out: torch.Tensor | None, table: torch.Tensor, indptr: torch.Tensor,
                   last: bool):
        """x [N, hidden] (ragged prompts) + mlp_out (the previous layer's MLP output, None at the
        first layer) is the layer's input -> (x after the attention's residual, this layer's MLP
        output; both None when last, k_for_gen, v). The residual adds run in the norms' kernels."""
        attn = self.self_attn
        if mlp_out is None:
            h = self.input_layernorm(x)
        else:
            h, x = self.input_layernorm.add_forward(x, mlp_out)
        q, k, kg, v = attn.understanding_qkv(h, table)
        if last:
            return None, None, kg, v
        o = ops.dense_attention(q, k, v, indptr, indptr, attn.scale, True)
        h, x = self.post_attention_layernorm.add_forward(x, attn.to_out(o.flatten(1)))
        return x, self.mlp(h), kg, v

    def generate(self, x: torch.Tensor, mlp_out: torch.Tensor | None, table: torch.Tensor, positions: torch.Tensor,
                 joint_k: torch.Tensor, joint_v: torch.Tensor, kv_rows: torch.Tensor, q_indptr: torch.Tensor,
                 kv_indptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [R * S, hidden] (R rows of S vision tokens) + mlp_out (the previous layer's MLP output,
        None at the first layer) is the layer's input; joint_k / joint_v [N, kv_heads, head_dim]
        this layer's keys and values of every row, [its prompt's ; its vision tokens'] (JointKV):
        the vision tokens' go into rows kv_rows. Returns (x after the attention's residual, this
        layer's MLP output): the next layer adds the two in the kernel of its first norm."""
        attn = self.self_attn
        if mlp_out is None:
            h = self.input_layernorm_moe_gen(x)
        else:
            h, x = self.input_layernorm_moe_gen.add_forward(x, mlp_out)
        q = attn.generation_q(h, table, positions, joint_k, joint_v, kv_rows)
        o = ops.dense_attention(q, joint_k, joint_v, q_indptr, kv_indptr, attn.scale, False)
        h, x = self.post_attention_layernorm_moe_gen.add_forward(x, attn.to_add_out(o.flatten(1)))
        return x, self.mlp_moe_gen(h)


@dataclass
class JointKV:
    """The generation tower's keys and values for R rows, laid out for its attention: row r holds
    [its prompt's L_r cached keys ; S rows the step writes its vision tokens' keys into], the rows
    one after the other. k, v [layers, sum(L_r + S), kv_heads, head_dim]; kv_rows [R * S] int64,
    where each vision token's key goes; prompt_lens (L_0, ..., L_R-1)."""
    k: torch.Tensor
    v: torch.Tensor
    kv_rows: torch.Tensor
    prompt_lens: tuple[int, ...]

    @classmethod
    def of(cls, und: list[UnderstandingKV], vision_tokens: int) -> "JointKV":
        S = int(vision_tokens)
        ks, vs, rows, off = [], [], [], 0
        for u in und:
            layers, L, hkv, d = u.k.shape
            scratch = u.k.new_empty((layers, S, hkv, d))
            ks += [u.k, scratch]
            vs += [u.v, torch.empty_like(scratch)]
            rows.append(torch.arange(off + L, off + L + S, device=u.k.device))
            off += L + S
        return cls(torch.cat(ks, dim=1), torch.cat(vs, dim=1), torch.cat(rows), tuple(u.length for u in und))


class Cosmos3Transformer(nn.Module):
    def __init__(self, config: Cosmos3TransformerConfig):
        super().__init__()
        config.check()
        self.config = config
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([Cosmos3Layer(c) for _ in range(c.num_hidden_layers)])
        self.norm_moe_gen = NemotronRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.proj_in = nn.Linear(c.patch_latent_dim, c.hidden_size)
        self.proj_out = nn.Linear(c.hidden_size, c.patch_latent_dim)
        self.time_embedder = TimestepMLP(TIME_FREQ_DIM, c.hidden_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.proj_out.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.proj_out.weight.device

    def fuse_projections(self) -> "Cosmos3Transformer":
        """Every layer's generation q / k / v projections as one matrix (Cosmos3Attention
        .fuse_generation_qkv): the last step of building a model on its device and dtype."""
        for layer in self.layers:
            layer.self_attn.fuse_generation_qkv()
        return self

    def to_fp8(self) -> "Cosmos3Transformer":
        """The generation tower's linear layers in float8 e4m3 (q / k / v, the attention's output, the
        MLP; Cosmos3Attention.generation_to_fp8), after the model is on its device and dtype."""
        for layer in self.layers:
            layer.self_attn.generation_to_fp8()
            to_fp8(layer.mlp_moe_gen, ("up_proj", "down_proj"))
        return self

    def to_dtype(self, dtype: torch.dtype) -> "Cosmos3Transformer":
        """Everything in dtype except time_embedder (float32, as diffusers keeps it)."""
        self.to(dtype)
        self.time_embedder.float()
        return self

    # -- the understanding tower ------------------------------------------------------------------
    @torch.inference_mode()
    def understand(self, prompts: list[list[int]], tables: list[torch.Tensor]) -> list[UnderstandingKV]:
        """Each prompt's token ids and rotary table ([L, head_dim], rope.py) -> its UnderstandingKV.
        The prompts run together (ragged causal rows)."""
        if len(prompts) != len(tables) or not prompts:
            raise ValueError("cosmos3 understand: one rotary table per prompt, at least one prompt")
        lens = [len(p) for p in prompts]
        if min(lens) < 1 or any(t.shape != (n, self.config.head_dim) for t, n in zip(tables, lens)):
            raise ValueError("cosmos3 understand: every prompt needs a token and a [L, head_dim] table")
        dev = self.device
        flat = [int(i) for p in prompts for i in p]
        if min(flat) < 0 or max(flat) >= self.config.vocab_size:  # checked on the host: no device read
            raise ValueError(f"cosmos3 understand: token ids must be in [0, {self.config.vocab_size})")
        ids = to_device(torch.tensor(flat, dtype=torch.long), dev)
        table = to_device(torch.cat(tables), dev)
        indptr = _indptr(lens)
        x, mlp_out = self.embed_tokens(ids), None
        ks, vs = [], []
        for i, layer in enumerate(self.layers):
            x, mlp_out, k, v = layer.understand(x, mlp_out, table, indptr, last=i == len(self.layers) - 1)
            ks.append(k)
            vs.append(v)
        k, v = torch.stack(ks), torch.stack(vs)  # [layers, N, kv_heads, head_dim]
        bounds = indptr.tolist()
        return [UnderstandingKV(k[:, a:b].clone(), v[:, a:b].clone()) for a, b in zip(bounds, bounds[1:])]

    # -- the generation tower ---------------------------------------------------------------------
    def time_embedding(self, timesteps: torch.Tensor) -> torch.Tensor:
        """timesteps [B] (the scheduler's integers) -> [B, hidden] in the model dtype."""
        t = timesteps.to(torch.long) * self.config.timestep_scale  # float32, as diffusers scales them
        w = self.time_embedder.linear_1.weight
        return self.time_embedder(timestep_embedding(t, TIME_FREQ_DIM).to(w.dtype)).to(self.dtype)

    def patchify(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, C, T, H, W] -> [B, T * h * w, p * p * C] (tokens in frame, row, column order)."""
        p = self.config.latent_patch_size
        B, C, T, H, W = latents.shape
        x = latents.view(B, C, T, H // p, p, W // p, p).permute(0, 2, 3, 5, 4, 6, 1)
        return x.reshape(B, T * (H // p) * (W // p), p * p * C)

    def unpatchify(self, x: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """[R, T * h * w, p * p * C] -> [R, C, T, h * p, w * p]."""
        p, C = self.config.latent_patch_size, self.config.latent_channel
        T, h, w = grid
        y = x.view(x.shape[0], T, h, w, p, p, C).permute(0, 6, 1, 2, 4, 3, 5)
        return y.reshape(x.shape[0], C, T, h * p, w * p)

    def grid(self, latents: torch.Tensor) -> tuple[int, int, int]:
        c, p = self.config, self.config.latent_patch_size
        if latents.dim() != 5 or latents.shape[1] != c.latent_channel:
            raise ValueError(f"cosmos3 transformer: latents must be [B, {c.latent_channel}, T, H, W], got "
                             f"{tuple(latents.shape)}")
        _, _, T, H, W = latents.shape
        if H % p or W % p:
            raise ValueError(f"cosmos3 transformer: latent H, W {(H, W)} must be multiples of the patch {p}")
        return T, H // p, W // p

    @torch.inference_mode()
    def generate(self, latents: torch.Tensor, timesteps: torch.Tensor, rows: list[int],
                 und: list[UnderstandingKV], table: torch.Tensor) -> torch.Tensor:
        """One denoising forward of R rows: row r is latents[rows[r]] at timesteps[rows[r]] after the
        prompt und[r]; table [R * S, head_dim] the rows' vision rotary tables, row after row.
        latents [B, C, T, H, W]; timesteps [B] -> velocity [R, C, T, H, W] in the model dtype."""
        T, h, w = self.grid(latents)
        S, R = T * h * w, len(rows)
        if len(und) != R or timesteps.shape != (latents.shape[0],) or table.shape != (R * S, self.config.head_dim):
            raise ValueError(f"cosmos3 generate: {R} rows need {R} prompts' K/V and a [{R * S}, "
                             f"{self.config.head_dim}] table, timesteps [{latents.shape[0]}]; got {len(und)}, "
                             f"{tuple(table.shape)}, {tuple(timesteps.shape)}")
        idx = to_device(torch.tensor(rows, dtype=torch.long), latents.device)
        joint = JointKV.of(und, S)
        return self.generate_rows(latents, timesteps, idx, table, joint.kv_rows, joint.k, joint.v, joint.prompt_lens)

    @torch.inference_mode()
    def generate_rows(self, latents: torch.Tensor, timesteps: torch.Tensor, rows: torch.Tensor, table: torch.Tensor,
                      kv_rows: torch.Tensor, joint_k: torch.Tensor, joint_v: torch.Tensor,
                      prompt_lens: tuple[int, ...]) -> torch.Tensor:
        """`generate` as a function of tensors and the prompts' lengths (what a CUDA graph captures):
        rows [R] int64 on the device; kv_rows, joint_k, joint_v, prompt_lens a JointKV's (the vision
        rows of joint_k / joint_v are scratch this writes)."""
        T, h, w = self.grid(latents)
        S, R = T * h * w, rows.shape[0]
        dt = self.dtype
        x = self.proj_in(self.patchify(latents.to(dt))) + self.time_embedding(timesteps)[:, None]  # [B, S, hidden]
        x = x.index_select(0, rows).reshape(R * S, -1)
        positions = torch.arange(R * S, device=x.device)
        q_indptr = _indptr([S] * R)
        kv_indptr = _indptr([n + S for n in prompt_lens])
        mlp_out = None
        for i, layer in enumerate(self.layers):
            x, mlp_out = layer.generate(x, mlp_out, table, positions, joint_k[i], joint_v[i], kv_rows, q_indptr,
                                        kv_indptr)
        out = self.proj_out(self.norm_moe_gen.add_forward(x, mlp_out)[0] if mlp_out is not None else self.norm_moe_gen(x))
        return self.unpatchify(out.view(R, S, -1), (T, h, w))


__all__ = ["TIME_FREQ_DIM", "FP32_MODULES", "UnderstandingKV", "JointKV", "NemotronRMSNorm", "ReLU2MLP", "Cosmos3Attention",
           "Cosmos3Layer", "Cosmos3Transformer"]
