"""The decoder-only causal LM scaffolding shared by mstar's models.

A model is `DecoderLM` plus the layers its subclass builds. The base class owns what
every model does the same way: embedding, the pre-norm residual stream (fused
add + RMSNorm between sub-layers), the final norm, the LM head (tied or not), binding
the runtime's caches, loading checkpoint tensors by name, and random initialisation.

The runtime-facing API of a token generator (keep it stable; other model kinds declare
theirs through interfaces.py):
    cache_spec() -> CacheSpec          bind_caches(ModelCaches)
    forward(ForwardContext) -> [T, hidden] hidden states after the final norm
    compute_logits(hidden) -> [N, vocab] float32
    greedy_tokens(hidden) -> [N] int64 (compute_logits(hidden).argmax(-1), without gathering at tp > 1)
    forward_segments() -> segments.DecoderSegments | None (piecewise prefill graphs)
    load_weights(iterable of (name, tensor))
    eos_token_ids, config, dtype, device, reads_device_loopback
"""

from __future__ import annotations

import logging
import math
from typing import Iterable

import torch
from torch import nn

from mstar import knobs
from mstar.models.context import CacheSpec, ForwardContext, ModelCaches
from mstar.models import parallel
from mstar.models.layers import (ParallelLMHead, QKNormAttention, RMSNorm, RotaryCache, VocabParallelEmbedding,
                                  weight_map)

log = logging.getLogger("mstar.models")


def state_dtype_for(weights: torch.dtype) -> torch.dtype:
    """The recurrent state pool's dtype (MSTAR_GDN_STATE_DTYPE) for a model with these weights:
    "auto" keeps half-precision models' state in bfloat16 and float32 models' in float32."""
    choice = knobs.value("MSTAR_GDN_STATE_DTYPE")
    if choice == "auto":
        return torch.bfloat16 if weights in (torch.bfloat16, torch.float16) else torch.float32
    return getattr(torch, choice)


class WeightLoadError(ValueError):
    """A checkpoint does not fit the model: a wrong shape, or missing tensors."""


class DecoderLayer(nn.Module):
    """Pre-norm block: mixer (attention or linear attention) then MLP, each with a residual.

    The mixer is stored under the checkpoint's name for it (`self_attn` / `linear_attn`).
    """

    def __init__(self, mixer_name: str, mixer: nn.Module, mlp: nn.Module, hidden: int, eps: float,
                 zero_centered: bool):
        super().__init__()
        self.mixer_name = mixer_name
        self.add_module(mixer_name, mixer)
        self.mlp = mlp
        self.uses_rope = isinstance(mixer, QKNormAttention)
        self.input_layernorm = RMSNorm(hidden, eps, zero_centered)
        self.post_attention_layernorm = RMSNorm(hidden, eps, zero_centered)

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    def forward(self, ctx: ForwardContext, h: torch.Tensor, residual: torch.Tensor | None,
                rope: RotaryCache) -> tuple[torch.Tensor, torch.Tensor]:
        # each norm with the product after it, and each elementwise op before a product with it,
        # as one op where the layers allow (ops/fused_linear.py: one kernel for a decode step's rows)
        mixer = self.mixer
        if hasattr(mixer, "core_post"):
            y, residual = self.input_layernorm.add_forward_linear(h, residual, mixer.input_projection())
            h = mixer.core_post(ctx, mixer.split_projection(y), rope)
        else:
            x, residual = self.input_layernorm.add_forward(h, residual)
            h = mixer(ctx, x, rope) if self.uses_rope else mixer(ctx, x)
        y, residual = self.post_attention_layernorm.add_forward_linear(h, residual, self.mlp.gate_up_proj)
        return self.mlp.down(y), residual


class TextModel(nn.Module):
    """Holds what checkpoints call `model.*`: embed_tokens, layers, norm."""

    def __init__(self, vocab: int, hidden: int, layers: list[DecoderLayer], eps: float, zero_centered: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(vocab, hidden)  # tp = 1: a plain Embedding
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden, eps, zero_centered)


def _as_id_tuple(v) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, int):
        return (v,)
    return tuple(int(x) for x in v)


def allocate_meta(module: nn.Module, device: torch.device | str) -> None:
    """Real (uninitialised) storage on `device` for every meta tensor of `module`. Not
    Module.to_empty: its empty_like on meta tensors goes through torch's Python refs, whose first
    use imports sympy (0.3 s idle, over 1 s on a busy host, in every process and tp rank)."""
    module._apply(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                  if t.is_meta else t)


class DecoderLM(nn.Module):
    """Base class. Subclasses set up `self.model` (a TextModel) and call `_finish_init`."""

    # checkpoint-name prefixes of multimodal checkpoints, rewritten to the text model's
    _PREFIX_REWRITES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                        ("language_model.lm_head.", "lm_head."), ("language_model.", "model."))
    _VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.",
                        "model.multi_modal_projector.", "multi_modal_projector.")
    _IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
    zero_centered_norm = False
    # The model's decode graphs may read their input tokens (and positions) from device
    # buffers the runtime's sampler writes (MSTAR_INGRAPH_DECODE_TOKENS, runtime/graphs/decode_masters.py):
    # True only where the forward reads nothing of ctx.input_ids / ctx.positions on the host.
    # False: the sampler writes nothing per step for it and the knob has no effect.
    reads_device_loopback = False

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.eos_token_ids: tuple[int, ...] = _as_id_tuple(getattr(config, "eos_token_id", None))
        # MTP (multi-token prediction) tensors of the checkpoint, by name without "mtp.";
        # kept for speculative decoding, unused by forward.
        self.mtp_weights: dict[str, torch.Tensor] = {}
        self._weight_map = None
        self._caches_bound = False
        # tensor parallel (parallel.py), fixed at construction; 1: a single device
        self.tp_size, self.tp_group = parallel.tp_size(), parallel.get_tp().group
        self.tp_rank = parallel.tp_rank()

    def _finish_init(self, rotary_dim: int, rope_theta: float) -> None:
        cfg = self.config
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size)  # tp = 1: a plain Linear
        self.rope = RotaryCache(cfg.max_position_embeddings, rotary_dim, rope_theta)
        attn_i = state_i = 0
        for layer in self.model.layers:
            m = layer.mixer
            if isinstance(m, QKNormAttention):
                m.attn_index = attn_i
                attn_i += 1
            else:
                m.state_index = state_i
                state_i += 1
        if self.tp_size > 1:
            self._defer_reduces()

    def _defer_reduces(self) -> None:
        """At tp > 1 each row-parallel output (the mixer's output projection, the MLP's down
        projection) leaves its all-reduce to the RMSNorm that adds it to the residual: the next
        sub-layer's pre-norm, or the final norm. Unfused, the same sum runs in the same place in
        the stream; fused (parallel.install_fused_reduce_norm), one kernel does sum, add and norm.
        Layer 0's input norm takes the embedding, which is summed by the embedding itself. A
        projection with a bias keeps its own sum (the bias comes after it)."""
        layers = self.model.layers
        for i, layer in enumerate(layers):
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            for site, proj, norm in ((2 * i, layer.mixer.output_projection(), layer.post_attention_layernorm),
                                     (2 * i + 1, layer.mlp.down_proj, nxt)):
                if proj.bias is None:
                    proj.defer_reduce()
                    norm.reduce_input(site, self.tp_group)

    # --- properties -------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def attention_layers(self) -> list[nn.Module]:
        return [layer.mixer for layer in self.model.layers if layer.uses_rope]

    @property
    def state_layers(self) -> list[nn.Module]:
        return [layer.mixer for layer in self.model.layers if not layer.uses_rope]

    # --- caches -----------------------------------------------------------------------------
    def memory_specs(self) -> list:
        """The per-request memory the model needs, as typed specs (context.CacheSpec.from_specs)."""
        return [m.spec() for m in self.attention_layers] + [m.spec() for m in self.state_layers]

    def cache_spec(self) -> CacheSpec:
        return CacheSpec.from_specs(self.memory_specs(), state_dtype=state_dtype_for(self.dtype))

    def _bind_paged_kv(self, caches: ModelCaches) -> None:
        """Check the paged K/V pools against the attention layers and bind them."""
        attn = self.attention_layers
        if len(caches.k_caches) != len(attn) or len(caches.v_caches) != len(attn):
            raise ValueError(f"bind_caches: model has {len(attn)} attention layers, got "
                             f"{len(caches.k_caches)} k and {len(caches.v_caches)} v caches")
        for i, (m, k, v) in enumerate(zip(attn, caches.k_caches, caches.v_caches)):
            if k.shape[-2:] != (m.num_kv_heads, m.head_dim) or v.shape != k.shape:
                raise ValueError(f"bind_caches: attention layer {i} wants "
                                 f"[pages, page_size, {m.num_kv_heads}, {m.head_dim}], got k "
                                 f"{tuple(k.shape)} v {tuple(v.shape)}")
        for m, k, v in zip(attn, caches.k_caches, caches.v_caches):
            m.k_cache, m.v_cache = k, v

    def bind_caches(self, caches: ModelCaches) -> None:
        state = self.state_layers
        self._bind_paged_kv(caches)
        if len(caches.conv_states) != len(state) or len(caches.recurrent_states) != len(state):
            raise ValueError(f"bind_caches: model has {len(state)} state layers, got "
                             f"{len(caches.conv_states)} conv and {len(caches.recurrent_states)} "
                             f"recurrent pools")
        for m, c, r in zip(state, caches.conv_states, caches.recurrent_states):
            m.bind_state(c, r)
        self._caches_bound = True

    # --- forward ----------------------------------------------------------------------------
    def forward(self, ctx: ForwardContext) -> torch.Tensor:
        if not self._caches_bound:
            raise RuntimeError("bind_caches() must be called before the first forward")
        h = self.model.embed_tokens(ctx.input_ids)
        residual = None
        for layer in self.model.layers:
            h, residual = layer(ctx, h, residual, self.rope)
        out, _ = self.model.norm.add_forward(h, residual)
        return out

    def segments_unsupported(self) -> str | None:
        """None if the forward can be given as segments (forward_segments), else why not."""
        from mstar.models.segments import DecoderSegments
        return DecoderSegments.unsupported(self)

    def forward_segments(self):
        """The forward cut at the mixer cores (segments.py), for piecewise prefill graphs; None
        when the model cannot be cut."""
        if self.segments_unsupported() is not None:
            return None
        from mstar.models.segments import DecoderSegments
        return DecoderSegments(self)

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def compute_logits_of(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """compute_logits(hidden) where only the `ids` columns (int64 [K] on the model's device)
        can matter: those columns' head rows alone are multiplied (their copy made once per ids
        tensor), every other column is -inf. float32 [N, vocab]; tp 1 only."""
        if self.tp_size != 1:
            raise ValueError("compute_logits_of: the vocabulary-parallel head computes every column")
        out = torch.full((hidden.shape[0], self.config.vocab_size), float("-inf"), dtype=torch.float32,
                         device=hidden.device)
        out.index_copy_(1, ids, self._logits_of_ids(hidden, ids))
        return out

    def _logits_of_ids(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """float32 [N, len(ids)]: the head's rows of `ids` (copied once per ids tensor) times hidden."""
        rows = getattr(self, "_head_rows", None)
        if rows is None or rows[0] is not ids:
            rows = self._head_rows = (ids, self.lm_head_weight().index_select(0, ids))
        return torch.nn.functional.linear(hidden, rows[1]).float()

    def compute_logits_at(self, hidden: torch.Tensor, ids: torch.Tensor, col_ids: torch.Tensor) -> torch.Tensor:
        """Row b's logits of tokens col_ids[b] (int64 [N, M], each in `ids`, or -1: -inf), float32
        [N, M]: the head's rows of `ids` multiplied once (compute_logits_of's product), then
        gathered per row. tp 1 only."""
        if self.tp_size != 1:
            raise ValueError("compute_logits_at: the vocabulary-parallel head computes every column")
        cols = getattr(self, "_head_cols", None)
        if cols is None or cols[0] is not ids:  # token id -> its column in ids (-1: not there)
            at = torch.full((self.config.vocab_size,), -1, dtype=torch.int64, device=ids.device)
            at[ids] = torch.arange(ids.shape[0], device=ids.device)
            cols = self._head_cols = (ids, at)
        dense = self._logits_of_ids(hidden, ids)
        c = cols[1][col_ids.clamp_min(0)]
        return dense.gather(1, c.clamp_min(0)).masked_fill_((col_ids < 0) | (c < 0), float("-inf"))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return torch.nn.functional.linear(hidden, self.lm_head_weight()).float()
        # vocab-parallel head: every rank computes its rows' logits; gather, drop the padding
        local = torch.nn.functional.linear(hidden, self.lm_head_weight())
        return parallel.all_gather_last(local, self.tp_size, self.tp_group)[:, :self.config.vocab_size].float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """compute_logits(hidden).argmax(-1), int64 [N]; at tp > 1 without gathering the logits
        (one gather of each rank's best (value, id) per row: parallel.vocab_parallel_argmax).
        Every rank calls it together, as compute_logits."""
        local = torch.nn.functional.linear(hidden, self.lm_head_weight())
        if self.tp_size == 1:  # the head's output in the model dtype orders as its float32 copy
            return local.argmax(dim=-1)
        return parallel.vocab_parallel_argmax(local, self.config.vocab_size, self.tp_rank, self.tp_size,
                                              self.tp_group)

    # --- weights ----------------------------------------------------------------------------
    def expected_weights(self) -> dict:
        """{checkpoint name: WeightSlot} of every tensor a checkpoint must provide."""
        if self._weight_map is None:
            wm = weight_map(self)
            self._weight_map = {k: v for k, v in wm.items() if not k.startswith("rope.")}
        return self._weight_map

    def checkpoint_name(self, name: str) -> str:
        for old, new in self._PREFIX_REWRITES:
            if name.startswith(old):
                return new + name[len(old):]
        return name

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into the model (converted to its dtype and device).

        Raises WeightLoadError on a shape mismatch (naming the tensor) and, at the end, on
        missing tensors. Vision tensors are skipped; `mtp.*` go to `self.mtp_weights`.
        Returns the set of model weight names loaded.
        """
        expected = self.expected_weights()
        loaded: set[str] = set()
        vision_skipped = 0
        unexpected: list[str] = []
        dev, dt = self.device, self.dtype
        with torch.no_grad():
            for raw_name, tensor in named_tensors:
                if raw_name.startswith(self._VISION_PREFIXES):
                    vision_skipped += 1
                    continue
                name = self.checkpoint_name(raw_name)
                if name.startswith("mtp."):
                    if not isinstance(tensor, torch.Tensor):  # a lazy slice (tensor parallel)
                        tensor = tensor[:]
                    self.mtp_weights[name[4:]] = tensor.to(device=dev, dtype=dt)
                    continue
                if name.endswith(self._IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and self.tie_word_embeddings:
                    continue  # tied: the embedding is the head
                slot = expected.get(name)
                if slot is None:
                    unexpected.append(raw_name)
                    continue
                shape = slot.source_shape(tensor)
                if shape != slot.shape:
                    raise WeightLoadError(f"checkpoint tensor {raw_name!r}: expected shape "
                                          f"{list(slot.shape)}, found {list(shape)}")
                slot.load(tensor)  # tensor parallel: only this rank's part
                loaded.add(name)
        if vision_skipped:
            log.info("skipped %d vision tensors (text model only)", vision_skipped)
        if unexpected:
            log.warning("ignored %d unexpected checkpoint tensors: %s%s", len(unexpected),
                        ", ".join(unexpected[:8]), " ..." if len(unexpected) > 8 else "")
        missing = sorted(set(expected) - loaded)
        if missing:
            raise WeightLoadError(f"checkpoint is missing {len(missing)} tensors: "
                                  f"{', '.join(missing[:16])}{' ...' if len(missing) > 16 else ''}")
        return loaded

    # --- init -------------------------------------------------------------------------------
    def materialize(self, device: torch.device | str) -> None:
        """Give meta parameters real (uninitialised) storage on `device`; build the rope table."""
        allocate_meta(self, device)
        self.rope.rebuild(device)
        self._weight_map = None

    def _init_param(self, name: str, p: torch.Tensor, module: nn.Module, std: float,
                    gen: torch.Generator) -> None:
        """Checkpoint-like init: norms at identity, biases zero, matrices N(0, std)."""
        if isinstance(module, RMSNorm):
            p.fill_(0.0 if module.zero_centered else 1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gen)

    def init_random(self, seed: int = 0, std: float | None = None) -> None:
        """Random weights, drawn on the model's device in its dtype (deterministic per device)."""
        std = float(std if std is not None else getattr(self.config, "initializer_range", 0.02))
        dev = self.device
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed)
        with torch.no_grad():
            for module in self.modules():
                for pname, p in module.named_parameters(recurse=False):
                    self._init_param(pname, p, module, std, gen)

    # --- stats ------------------------------------------------------------------------------
    def num_parameters(self) -> int:
        """Text-model parameters (the tied head counted once), from shapes (works on meta)."""
        return sum(math.prod(p.shape) for p in self.parameters())
