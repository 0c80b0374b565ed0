"""Qwen3.5 (text model): hybrid Gated DeltaNet / gated full attention decoder.

Computes what transformers' `Qwen3_5ForCausalLM` computes, on mstar.ops:
  * RMSNorms are zero-centred (weight acts as 1 + w), including the per-head q/k norms;
  * full-attention layers: q_proj yields [query | gate] per head, q/k RMSNorm, NeoX RoPE
    on the first `partial_rotary_factor * head_dim` dims, GQA, sigmoid(gate) * attn before
    o_proj;
  * linear-attention layers (Gated DeltaNet): qkv projection -> causal depthwise conv1d +
    SiLU -> split q, k, v; q, k L2-normalised and repeated onto the value heads
    (key head i serves value heads i*r .. i*r+r-1); beta = sigmoid(b),
    g = -exp(A_log) * softplus(a + dt_bias); gated delta rule with scale Dk^-0.5; output
    RMSNorm (plain weight) gated by silu(z); out_proj;
  * SwiGLU MLP; `config.layer_types` picks the mixer of each layer.
Checkpoint names are those of Qwen3_5ForCausalLM (VL checkpoints' `model.language_model.`
prefix is rewritten by the base class).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mstar import ops
from mstar.models.base import DecoderLayer, DecoderLM, TextModel
from mstar.models.context import ForwardContext, StateLayerSpec
from mstar.models import parallel
from mstar.models.layers import (FusedLinear, GatedMLP, ParamHolder, QKNormAttention, RowParallelLinear,
                                  rope_settings, set_shard)
from mstar.models.layers.linear import fusable_weight

L2_EPS = 1e-6  # transformers' l2norm eps in the gated delta rule


class GatedRMSNorm(nn.Module):
    """rmsnorm(x) * w * silu(z) over the last dim (plain weight, initialised to ones)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = float(eps)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return ops.gated_rms_norm(x, z, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention mixer over the runtime's conv/recurrent state pools."""

    def __init__(self, config):
        super().__init__()
        self.hidden = config.hidden_size
        hk_all, hv_all = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        if hv_all % hk_all:
            raise ValueError(f"linear_num_value_heads ({hv_all}) must be a multiple of "
                             f"linear_num_key_heads ({hk_all})")
        # tensor parallel: a contiguous block of key heads and the value heads they serve
        size, rank = parallel.tp_size(), parallel.tp_rank()
        hk0, self.num_k_heads = parallel.block(hk_all, rank, size, "linear_num_key_heads")
        hv0, self.num_v_heads = parallel.block(hv_all, rank, size, "linear_num_value_heads")
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = config.linear_conv_kernel_dim
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"Gated DeltaNet conv activation {act!r} is not supported (only silu)")
        # checkpoint: in_proj_qkv [conv_dim, H]; in_proj_z [value_dim, H]; in_proj_b/a [Hv, H]: one
        # matmul of x (a decode step: one launch instead of two, one larger read of the weights)
        src = qkv = None
        if size > 1:
            # q, k, v channels of the fused projection and of the conv, each sliced by head
            kd, vd = self.key_dim, self.value_dim
            kd_all, vd_all = hk_all * self.head_k_dim, hv_all * self.head_v_dim
            qkv = ((hk0 * self.head_k_dim, 0, kd), (kd_all + hk0 * self.head_k_dim, kd, kd),
                   (2 * kd_all + hv0 * self.head_v_dim, 2 * kd, vd))
            src = ((2 * kd_all + vd_all, qkv), (hv0 * self.head_v_dim, vd_all), (hv0, hv_all), (hv0, hv_all))
        self.in_proj = FusedLinear(self.hidden, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
                                   (self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads), sources=src)
        self.conv1d = ParamHolder(self.conv_dim, 1, self.conv_kernel)  # depthwise, no bias
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)  # per head dim: replicated
        self.out_proj = RowParallelLinear(hv_all * self.head_v_dim, self.hidden)
        if size > 1:
            set_shard(self.conv1d, "weight", (2 * kd_all + vd_all, 1, self.conv_kernel), qkv)
            for name in ("dt_bias", "A_log"):
                set_shard(self, name, (hv_all,), ((hv0, 0, self.num_v_heads),))
        self.scale = self.head_k_dim ** -0.5
        self.state_index = -1
        self.conv_state: torch.Tensor | None = None
        self.recurrent_state: torch.Tensor | None = None

    def spec(self) -> StateLayerSpec:
        return StateLayerSpec(conv_dim=self.conv_dim, conv_kernel=self.conv_kernel, num_heads=self.num_v_heads,
                              key_dim=self.head_k_dim, value_dim=self.head_v_dim)

    def bind_state(self, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        want_c = (self.conv_dim, self.conv_kernel - 1)
        want_r = (self.num_v_heads, self.head_k_dim, self.head_v_dim)
        if tuple(conv_state.shape[1:]) != want_c or tuple(recurrent_state.shape[1:]) != want_r:
            raise ValueError(f"bind_caches: GDN layer {self.state_index} wants conv [slots, {want_c[0]}, "
                             f"{want_c[1]}] and state [slots, {', '.join(map(str, want_r))}], got "
                             f"{tuple(conv_state.shape)} and {tuple(recurrent_state.shape)}")
        self.conv_state, self.recurrent_state = conv_state, recurrent_state

    # The forward in three parts (as QKNormAttention's; runtime/graphs/prefill_graphs.py): the input
    # projections, the conv / recurrence over the state pools (reads the step's metadata), the
    # output projection.
    def pre(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.split_projection(self.in_proj(x))

    def input_projection(self) -> FusedLinear:
        return self.in_proj

    def split_projection(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """pre's outputs from in_proj's [T, conv_dim | value_dim + 2 Hv]: two column views (the conv
        kernels take row strides)."""
        return y[:, :self.conv_dim], y[:, self.conv_dim:]

    def post(self, o: torch.Tensor) -> torch.Tensor:
        return self.out_proj(o)

    def output_projection(self) -> RowParallelLinear:
        return self.out_proj

    def core_width(self) -> int:
        """Features per token of core's output (what post reads)."""
        return self.value_dim

    def forward(self, ctx: ForwardContext, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.core(ctx, self.pre(x)))

    def core(self, ctx: ForwardContext, pre: tuple[torch.Tensor, ...], rope=None) -> torch.Tensor:
        o, z = self._recur(ctx, pre)
        t = o.shape[0]
        return self.norm(o, z).reshape(t, self.value_dim)

    def core_post(self, ctx: ForwardContext, pre: tuple[torch.Tensor, ...], rope=None) -> torch.Tensor:
        """post(core(...)), the gated norm and out_proj one op where they can be."""
        weight = fusable_weight(self.out_proj)
        if weight is None:
            return self.post(self.core(ctx, pre))
        o, z = self._recur(ctx, pre)
        return ops.gated_rms_norm_linear(o, z, self.norm.weight, self.norm.eps, weight)

    def _recur(self, ctx: ForwardContext, pre: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the recurrence's output [T, Hv, Dv] in the activation dtype, the gate z [T, Hv, Dv] as a view
        of the projection): the conv and the gated delta rule over the state pools."""
        mixed, zba = pre
        t = mixed.shape[0]
        nd = ctx.num_decode_tokens
        md = ctx.state
        hk, hv, dv = self.num_k_heads, self.num_v_heads, self.head_v_dim
        z = zba[:, :self.value_dim]
        b = zba[:, self.value_dim:self.value_dim + hv]
        a = zba[:, self.value_dim + hv:]

        w = self.conv1d.weight.view(self.conv_dim, self.conv_kernel)
        outs = []
        if nd > 0:  # decode rows: conv update, then one op from the conv output on (fused on CUDA)
            conv = ops.causal_conv1d_update(mixed[:nd], w, None, self.conv_state, md.decode_slots, True)
            outs.append(ops.gdn_decode_fused(conv, a[:nd], b[:nd], self.A_log, self.dt_bias,
                                             self.recurrent_state, md.decode_slots, hk, self.scale, L2_EPS))
        if t > nd:
            conv = ops.causal_conv1d_prefill(mixed[nd:], w, None, self.conv_state, md.prefill_cu_seqlens,
                                             md.prefill_slots, md.snap_token_idx, md.snap_slots, True)
            outs.append(ops.gdn_prefill_fused(conv, a[nd:], b[nd:], self.A_log, self.dt_bias, self.recurrent_state,
                                              md.prefill_cu_seqlens, md.prefill_slots, md.snap_token_idx,
                                              md.snap_slots, hk, self.scale, L2_EPS))
        o = outs[0] if len(outs) == 1 else torch.cat(outs, 0)  # [T, Hv, Dv]
        return o.to(mixed.dtype), z.reshape(t, hv, dv)


class Qwen3_5ForCausalLM(DecoderLM):
    zero_centered_norm = True
    reads_device_loopback = True  # decode graphs may gather input ids / positions on the device

    def __init__(self, config):
        super().__init__(config)
        c = config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        theta, factor = rope_settings(c)
        rotary_dim = int(head_dim * factor)
        layer_types = list(c.layer_types)
        if len(layer_types) != c.num_hidden_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {c.num_hidden_layers} layers")
        layers = []
        for kind in layer_types:
            if kind == "full_attention":
                name, mixer = "self_attn", QKNormAttention(
                    hidden=c.hidden_size, num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                    head_dim=head_dim, eps=c.rms_norm_eps, zero_centered_norm=True, output_gate=True,
                    bias=bool(getattr(c, "attention_bias", False)))
            elif kind == "linear_attention":
                name, mixer = "linear_attn", GatedDeltaNet(c)
            else:
                raise ValueError(f"unknown Qwen3.5 layer type {kind!r}")
            layers.append(DecoderLayer(name, mixer, GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act),
                                       c.hidden_size, c.rms_norm_eps, zero_centered=True))
        self.model = TextModel(c.vocab_size, c.hidden_size, layers, c.rms_norm_eps, zero_centered=True)
        self._finish_init(rotary_dim, theta)

    def _init_param(self, name, p, module, std, gen):
        if isinstance(module, GatedDeltaNet) and name == "A_log":
            # as transformers: A ~ U(0.01, 16) (a real checkpoint's range), stored as log
            p.uniform_(0.01, 16.0, generator=gen).log_()
        elif isinstance(module, GatedDeltaNet) and name == "dt_bias":
            p.fill_(1.0)
        elif isinstance(module, GatedRMSNorm):
            p.fill_(1.0)
        elif isinstance(module, ParamHolder):  # conv1d: kaiming-uniform-like fan_in = K
            bound = 1.0 / math.sqrt(p.shape[-1])
            p.uniform_(-bound, bound, generator=gen)
        else:
            super()._init_param(name, p, module, std, gen)
