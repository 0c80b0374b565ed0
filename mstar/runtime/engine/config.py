"""Engine configuration: one dataclass, validated once, resolved against the machine.

`EngineConfig` holds what a user asks for; `resolve_device`, `resolve_dtype`, `resolve_max_num_seqs` and
`size_caches` turn the "auto" / None values into concrete ones once the model's cache
spec is known. Errors name the field (ValueError "field: message").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import sys
from typing import TYPE_CHECKING

from mstar import knobs
from mstar.models.presets import DEFAULT_MODEL

if TYPE_CHECKING:
    import torch

# dtype names -> torch attribute names (this module imports torch only when it resolves one: the
# server's API process builds an EngineConfig and starts the engine before it imports torch)
_DTYPES = {"float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16", "half": "float16"}


def _is_torch_dtype(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.dtype)

# CPU has no "free memory" figure worth trusting; caches get this many bytes by default. On CUDA
# they get memory_plan.CACHE_FRACTION of the free device memory (after the model is loaded).
CPU_CACHE_BYTES = 1 << 30


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    random_weights: bool = False
    # a companion model the family runs beside the LM (a speech LM's audio codec): a directory or
    # a preset name; None: the family's default (a directory beside the model's, else its preset)
    codec: str | None = None
    dtype: str = "auto"  # "auto": fp32 on CPU, bf16 on CUDA
    device: str = "auto"  # "auto": cuda if available, else cpu
    max_num_seqs: int | None = None  # None: 256 on CUDA (vLLM's default there), 64 elsewhere (resolve_max_num_seqs)
    max_model_len: int | None = None  # None: min(max_position_embeddings, 4096)
    page_size: int | None = None  # None: knob MSTAR_PAGE_SIZE
    num_pages: int | None = None  # None: sized from free memory (CUDA) or CPU_CACHE_BYTES
    max_num_batched_tokens: int | None = None  # tokens per step; None: 8192 on CUDA, 2048 elsewhere
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"  # "recompute" | "offload"
    tp: int = 1  # tensor-parallel ranks, one device each (runtime/parallel/tp.py); must divide the head counts
    seed: int = 0
    # None: sized with the caches (hybrid models with prefix caching only)
    num_snapshot_slots: int | None = None
    cache_memory_bytes: int | None = None  # None: see CPU_CACHE_BYTES / memory_plan.CACHE_FRACTION
    # decode-only steps: "auto" replays CUDA graphs on CUDA (cuda_graphs.py) and runs eagerly
    # elsewhere; "off" always eager; "static" the graphs' fixed buffers and padding without
    # capturing (any device: how CPU tests check the graph path's inputs)
    decode_graphs: str = "auto"
    max_graph_batch: int = 256  # largest captured decode batch (capped by max_num_seqs)
    # overlapped decode (decode_overlap.py): launch decode step k before reading step k-1's
    # tokens back; with decode graphs only. "auto": on where graphs are captured (CUDA, any tp);
    # True/False = on/off (measured: notes/gpu-2026-11-30-overlapped-decode.md)
    async_output: str | bool = "auto"
    # admission batching (scheduler.py): admit this many at once (None = max_num_seqs // 4 when
    # decode graphs run, else 0: at once)
    admit_min_free: int | None = None
    # ...or once they have been held this many decode steps (0: never held; how long requests wait
    # for admission: notes/gpu-2026-11-30-idle-gather.md)
    admit_max_wait: int = 16
    # torch.compile the model's forward (compiled_forward.py): "on" (every step), "decode" (only
    # the forward the decode graphs capture: two compiles, b = 1 and b > 1), "off"; "auto" is off
    # (eager steps recompile per new 0/1-sized input; notes/gpu-2026-11-30-graphs.md)
    compile: str = "auto"
    # prefill and mixed steps (prefill_graphs.py): "on" replays piecewise CUDA graphs around the
    # attention / GDN cores at padded token counts (CUDA, decoder-only models, every rank); "auto"
    # does so on CUDA at tp = 1 (measured: notes/gpu-2026-11-30-prefill-graphs.md); "static" the same
    # segments and padding without capturing (any device: CPU tests); "off" the plain forward
    prefill_graphs: str = "auto"
    # start-up warm-up (engine_core.py): short prefills (one row, then three ragged rows) and
    # decodes before the engine reports ready, so first-use kernel builds (FlashInfer's prefill
    # JIT, fla's autotuning, Triton's variants) happen at start-up and not inside a served request
    # (Whisper: one second of silence). "auto": on CUDA
    warmup: str = "auto"

    def __post_init__(self):
        if self.max_num_seqs is None and self.device != "auto":
            self.resolve_max_num_seqs()
        self.validate()

    @classmethod
    def from_kwargs(cls, **kw) -> EngineConfig:
        names = {f.name for f in fields(cls)}
        for k in kw:
            if k not in names:
                raise ValueError(f"{k}: unknown engine option (known: {sorted(names)})")
        return cls(**kw)

    def validate(self) -> None:
        def pos(name, allow_none=False):
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: must be a positive integer, got {v!r}")

        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model: must be a preset name or a directory, got {self.model!r}")
        if self.codec is not None and (not isinstance(self.codec, str) or not self.codec):
            raise ValueError(f"codec: must be a directory or a preset name, got {self.codec!r}")
        pos("max_num_seqs", True)  # None until resolve_max_num_seqs (device "auto")
        pos("max_model_len", True)
        pos("page_size", True)
        pos("num_pages", True)
        pos("max_num_batched_tokens", True)
        if self.admit_min_free is not None and (not isinstance(self.admit_min_free, int) or self.admit_min_free < 0):
            raise ValueError(f"admit_min_free: must be >= 0, got {self.admit_min_free!r}")
        if not isinstance(self.admit_max_wait, int) or self.admit_max_wait < 0:
            raise ValueError(f"admit_max_wait: must be an int >= 0, got {self.admit_max_wait!r}")
        pos("tp")
        pos("max_graph_batch")
        if self.compile not in ("auto", "on", "decode", "off"):
            raise ValueError(f"compile: must be 'auto', 'on', 'decode' or 'off', got {self.compile!r}")
        if self.async_output is True or self.async_output is False:
            self.async_output = "on" if self.async_output else "off"
        if self.async_output not in ("auto", "on", "off"):
            raise ValueError(f"async_output: must be 'auto', 'on' or 'off', got {self.async_output!r}")
        if self.prefill_graphs not in ("auto", "on", "off", "static"):
            raise ValueError(f"prefill_graphs: must be 'auto', 'on', 'off' or 'static', got {self.prefill_graphs!r}")
        if self.warmup not in ("auto", "on", "off"):
            raise ValueError(f"warmup: must be 'auto', 'on' or 'off', got {self.warmup!r}")
        if self.decode_graphs not in ("auto", "off", "static"):
            raise ValueError(f"decode_graphs: must be 'auto', 'off' or 'static', got {self.decode_graphs!r}")
        if self.num_snapshot_slots is not None and (not isinstance(self.num_snapshot_slots, int)
                                                    or self.num_snapshot_slots < 0):
            raise ValueError(f"num_snapshot_slots: must be >= 0, got {self.num_snapshot_slots!r}")
        if self.preemption_mode not in ("recompute", "offload"):
            raise ValueError(f"preemption_mode: must be 'recompute' or 'offload', got {self.preemption_mode!r}")
        if self.dtype != "auto" and self.dtype not in _DTYPES and not _is_torch_dtype(self.dtype):
            raise ValueError(f"dtype: must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.device, str):
            raise ValueError(f"device: must be a string, got {self.device!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed: must be an integer, got {self.seed!r}")

    # --- resolution ----------------------------------------------------------------------------
    def resolve_device(self) -> torch.device:
        import torch
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_max_num_seqs(self) -> int:
        """max_num_seqs, its default filled in. With device "auto" the default waits for this call
        (the engine makes it), so that a config is built without importing torch or touching CUDA
        (the server's API process builds one)."""
        if self.max_num_seqs is None:
            kind = self.resolve_device().type if self.device == "auto" else self.device.partition(":")[0]
            self.max_num_seqs = 256 if kind == "cuda" else 64
        return self.max_num_seqs

    def resolve_dtype(self, device: torch.device | None = None) -> torch.dtype:
        import torch
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype == "auto":
            device = device or self.resolve_device()
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, _DTYPES[self.dtype])

    def resolve_max_num_batched_tokens(self, device: torch.device) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 8192 if device.type == "cuda" else 2048

    def resolve_page_size(self) -> int:
        return int(self.page_size if self.page_size is not None else knobs.value("MSTAR_PAGE_SIZE"))

    def resolve_max_model_len(self, max_position_embeddings: int | None) -> int:
        if self.max_model_len is not None:
            if max_position_embeddings and self.max_model_len > max_position_embeddings:
                raise ValueError(f"max_model_len: {self.max_model_len} exceeds the model's "
                                 f"max_position_embeddings {max_position_embeddings}")
            return self.max_model_len
        return min(int(max_position_embeddings or 4096), 4096)


@dataclass
class CacheSizes:
    num_pages: int
    page_size: int
    num_slots: int
    num_snapshot_slots: int
    num_cross_slots: int = 0  # models with per-request slots (spec.cross): one per running request


def size_caches(cfg: EngineConfig, spec, dtype: torch.dtype, device: torch.device,
                max_model_len: int) -> CacheSizes:
    """Pick page / slot counts from the config, the cache spec and the memory at hand."""
    import torch

    from mstar.models.memory_plan import CACHE_FRACTION, default_snapshot_slots
    page_size = cfg.resolve_page_size()
    has_state = len(spec.state) > 0
    has_attn = len(spec.attention) > 0
    page_bytes = max(1, spec.kv_bytes_per_token(dtype) * page_size)
    state_bytes = spec.state_bytes_per_sequence(dtype) if has_state else 0
    num_slots = cfg.resolve_max_num_seqs()
    pages_per_seq = math.ceil(max_model_len / page_size)

    if cfg.cache_memory_bytes is not None:
        budget = cfg.cache_memory_bytes
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * CACHE_FRACTION)
    else:
        budget = CPU_CACHE_BYTES
    budget -= num_slots * state_bytes
    num_cross = 0
    if getattr(spec, "cross", None) is not None:
        # cross slots first (the scarce resource): at most max_num_seqs, at most 3/4 of the budget
        cross_bytes = max(1, spec.cross_bytes_per_sequence(dtype))
        num_cross = int(min(num_slots, max(budget, 0) * 3 // 4 // cross_bytes))
        if num_cross < 1:
            if device.type == "cuda":
                raise RuntimeError(f"not enough device memory for one cross-attention slot ({cross_bytes} bytes)")
            num_cross = 1
        budget -= num_cross * cross_bytes

    snap = cfg.num_snapshot_slots
    if snap is None:
        if has_state and cfg.enable_prefix_caching:
            snap = default_snapshot_slots(num_slots, budget, state_bytes)
        else:
            snap = 0
    budget -= snap * state_bytes

    if cfg.num_pages is not None:
        num_pages = cfg.num_pages
    elif not has_attn:
        num_pages = num_slots * pages_per_seq + 1  # page bookkeeping only; no KV tensors
    else:
        want = num_slots * pages_per_seq + 1
        num_pages = int(min(want, max(budget, 0) // page_bytes))
        if num_pages < pages_per_seq + 1:
            if device.type == "cuda":
                raise RuntimeError(f"not enough device memory for one sequence of {max_model_len} tokens "
                                   f"({pages_per_seq} pages of {page_bytes} bytes); lower max_model_len")
            num_pages = pages_per_seq + 1
    return CacheSizes(num_pages=num_pages, page_size=page_size, num_slots=num_slots,
                      num_snapshot_slots=snap, num_cross_slots=num_cross)
