"""Every MSTAR_* setting, in one table.

The table is the single source of truth: README's knob table is generated from it
(`python -m mstar.runtime.knobs --markdown`), values are parsed once from the
environment, and a bad value or an unknown MSTAR_* name stops the process at start-up
with the knob's name in the message.

This module sits below `mstar.ops` so that every layer can read knobs without
depending upward; `mstar.runtime.knobs` is its command-line face.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator


class KnobError(ValueError):
    """A MSTAR_* environment variable is unknown or has a value its knob rejects."""


def _parse_bool(raw: str) -> bool:
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected 0/1/true/false")


def _parse_int(raw: str) -> int:
    return int(raw.strip(), 10)


def _parse_str(raw: str) -> str:
    return raw.strip()


@dataclass(frozen=True)
class Knob:
    name: str
    type: str  # "bool" | "int" | "str" | "choice"
    default: Any
    meaning: str
    choices: tuple = ()
    minimum: int | None = None

    def parse(self, raw: str) -> Any:
        try:
            if self.type == "bool":
                return _parse_bool(raw)
            if self.type == "int":
                v = _parse_int(raw)
                if self.minimum is not None and v < self.minimum:
                    raise ValueError(f"must be >= {self.minimum}")
                if self.choices and v not in self.choices:
                    raise ValueError(f"must be one of {list(self.choices)}")
                return v
            if self.type == "choice":
                v = _parse_str(raw)
                if v not in self.choices:
                    raise ValueError(f"must be one of {list(self.choices)}")
                return v
            return _parse_str(raw)
        except ValueError as e:
            raise KnobError(f"{self.name}={raw!r}: {e}") from None


# The table. Keep it sorted by area; every entry needs a test (tests/test_knobs.py checks
# that each knob parses its default and rejects garbage where it has a type).
KNOBS: tuple[Knob, ...] = (
    # --- op layer -------------------------------------------------------------------------
    Knob("MSTAR_BACKENDS", "str", "",
         "Per-op backend choice, e.g. 'rms_norm=triton,gdn_prefill=fla' or '*=reference'. "
         "Empty: each op uses its fastest available backend for the tensor's device."),
    Knob("MSTAR_PREFILL_ATTENTION", "choice", "auto",
         "FlashInfer's backend for paged prefill: 'auto' (on Hopper fa3 where its module is in the kernel "
         "cache, else fa2, whose module decode needs anyway: a cold start compiles one module, not two; "
         "elsewhere FlashInfer's choice), 'fa2' or 'fa3' (one start with fa3 puts its module in the cache). "
         "Fixed per process at its first prefill.",
         choices=("auto", "fa2", "fa3")),
    Knob("MSTAR_FUSED_LINEAR_SHAPES", "choice", "tuned",
         "Where the fused-linear ops (a norm, gate or activation folded into the product after it) run their "
         "Triton kernel in a one-row decode step on CUDA. tuned: at the product shapes whose block shapes "
         "were measured (Qwen3.5 0.8B and 4B; notes/llm-decode-step.md), the composed pair (the elementwise "
         "op's kernel, then cuBLAS) elsewhere. any: at every shape, the others with 8 output features and K "
         "blocks of 512 a program; for checking a model's products through the kernel (the trained-checkpoint "
         "gate's small model has none in the table) before tuning them with probe_fused_linear. The tuned "
         "shapes run the same kernel either way.",
         choices=("tuned", "any")),
    Knob("MSTAR_PDL", "bool", False,
         "Programmatic dependent launch (Hopper and newer) for the Triton kernels of a one-row decode chain: "
         "the fused-linear products, the conv update and the GDN decode step. Such a kernel is launched while "
         "the kernel before it on the stream finishes; it asks L2 for what no kernel writes (a product's "
         "first weights) and waits for the earlier kernel's outputs before reading them or writing anything. Off: each "
         "kernel starts after the one before it ends. Outputs are identical either way. Served one-row "
         "decode was slower with it on an H100 (notes/llm-decode-step.md)."),
    Knob("MSTAR_VERIFY", "bool", False,
         "Run the reference beside the selected backend on live inputs and record the largest "
         "difference per op (`mstar.ops.verify_report()`). Slow; for checking kernels."),
    # --- compile caches --------------------------------------------------------------------
    Knob("MSTAR_KERNEL_CACHE", "str", "",
         "Root of the on-disk compile caches (CuTe AOT objects, Triton, Inductor, FlashInfer). "
         "Empty: ./kernel_cache in the working directory."),
    Knob("MSTAR_KERNEL_CACHE_DISABLE", "bool", False,
         "Bypass the on-disk compile caches: CuTe kernels are compiled in each process (needs the DSL) "
         "and never read from or written to disk, and Triton, Inductor and FlashInfer keep their own "
         "default cache locations."),
    Knob("MSTAR_CUTE_RUNTIME_LIB", "str", "",
         "Path to libcute_dsl_runtime.so for loading CuTe kernels compiled ahead of time."),
    # --- runtime ---------------------------------------------------------------------------
    Knob("MSTAR_PAGE_SIZE", "int", 16,
         "Tokens per KV page (also the prefix-cache granule and GDN snapshot stride with MSTAR_GDN_SNAPSHOTS=page).",
         minimum=1),
    Knob("MSTAR_GDN_SNAPSHOTS", "choice", "chunk-end",
         "Where prefill keeps prefix-cache snapshots of the GDN state: chunk-end = at the last page "
         "boundary of each prefill chunk (one GDN prefill call per row); page = at every page boundary "
         "(prefix hits at any page, but the GDN prefill then runs one call per page, which makes prefill steps "
         "far slower: notes/gpu-2026-11-30-graphs.md).", choices=("chunk-end", "page")),
    # --- decode step (host-side savings around the decode graphs; off by default, notes/decode-knobs.md) ---
    Knob("MSTAR_KV_PLAN_CACHE", "int", 0,
         "Decode page-table arrays. 0: rebuilt from the block tables every step. 1: when a step's decode rows "
         "are the previous step's rows, each one token longer, the previous arrays are advanced (positions and "
         "last-page lengths + 1, a page appended where a row crossed a page boundary); anything else that "
         "touches a stream (reset, remove, reload, offload, rollback, release, fork, copy-on-write, prefix-cache "
         "reset) invalidates them. 2: wherever it can advance, build both, log every difference at WARNING and "
         "use the rebuilt arrays. Graph and eager decode rows. FlashInfer's own plan still runs every step."
         " Measured against the default: notes/decode-knobs.md.",
         choices=(0, 1, 2)),
    Knob("MSTAR_KV_PINNED_INDPTRS", "bool", False,
         "Eager steps (prefill, mixed) stage their index arrays in a preallocated page-locked ring and copy "
         "them straight to the device, instead of pinning fresh host tensors per step (decode graphs always "
         "stage through fixed pinned buffers)."
         " Measured against the default: notes/decode-knobs.md."),
    Knob("MSTAR_INGRAPH_DECODE_TOKENS", "bool", False,
         "Decode graphs read each row's input token inside the graph from a per-request master buffer on the "
         "device (max_num_seqs slots, allocated once before capture, never grown or moved); the sampler (and "
         "overlapped decode's launch, which then needs no loop-back copy) writes sampled tokens into it, so no "
         "token ids are uploaded. Only for models that declare `reads_device_loopback` (Qwen3.5, Qwen3), with "
         "decode graphs on and tp = 1; elsewhere a warning and no effect. A request beyond the capacity fails "
         "with an error that names it."
         " Measured against the default: notes/decode-knobs.md."),
    Knob("MSTAR_INGRAPH_DECODE_ROPE", "bool", False,
         "With MSTAR_INGRAPH_DECODE_TOKENS: decode graphs compute each row's position (and so its rotary "
         "angle) inside the graph from a per-request device counter, advanced inside the graph (the host "
         "rewrites it only at admission and after eager steps), instead of uploading positions. Set without "
         "MSTAR_INGRAPH_DECODE_TOKENS, the engine refuses to start."
         " Measured against the default: notes/decode-knobs.md."),
    Knob("MSTAR_KV_CHAIN_LAZY_STEPS", "int", 1,
         "Register the pages decode fills in the prefix cache on every N-th commit of the request instead of "
         "at once (prompt pages and pages with GDN snapshots: at once); pending pages are registered before "
         "the request's pages are released, offloaded, forked or rolled back, and before a prefix-cache reset."
         " Measured against the default: notes/decode-knobs.md.",
         minimum=1),
    Knob("MSTAR_IDLE_GATHER_US", "int", 0,
         "Engine process: when a request arrives while no step runs (the engine is idle, or requests only wait "
         "for admission), keep taking arrivals for this many microseconds before the next step, so that a burst "
         "(a closed-loop wave, a client's batch) is prefilled in one step rather than its first request alone. "
         "0: step at once. The cost: a lone request (c1) waits the whole window. Measured: "
         "notes/gpu-2026-11-30-idle-gather.md, notes/gpu-2026-12-01-allreduce-norm.md.",
         minimum=0),
    Knob("MSTAR_REFILL_GATHER_US", "int", 10000,
         "Engine process: closed-loop clients (each sends its next request when its last one ends) owe the "
         "engine a request per finished one. While some are owed and nothing runs, the engine waits for them, "
         "up to this many microseconds after the last finish, so that a wave of clients whose requests ended "
         "together is prefilled in one step rather than its first arrival alone and the rest a step later. "
         "A lone client (c1) settles what it owes with its one request and waits nothing; a request arriving "
         "after the window waits nothing. 0: off (step at the first arrival). Measured: notes/llm-serving.md.",
         minimum=0),
    Knob("MSTAR_GDN_STATE_DTYPE", "choice", "auto",
         "Dtype of the Gated DeltaNet recurrent state pool (and its prefix-cache snapshots). auto: bfloat16 "
         "where the model's weights are bfloat16 or float16 (the served default on CUDA), float32 where they "
         "are float32 (the CPU path, the float32 parity tests). bfloat16 halves the bytes a decode step reads "
         "and writes per row and the memory per sequence; every kernel still computes in float32 and rounds "
         "the state when it stores it. The correctness gate (trained checkpoint, strict, logprob check) passes "
         "with it on the GPU, and the CPU gate with float32 weights. Measured: notes/llm-serving.md.",
         choices=("auto", "float32", "bfloat16")),
    Knob("MSTAR_TP_ALLREDUCE", "choice", "nccl",
         "How tensor-parallel ranks sum the row-parallel outputs (tp > 1): nccl = torch.distributed.all_reduce "
         "(gloo on CPU); symm_mem = PyTorch symmetric memory's one-shot all-reduce (every rank reads its peers' "
         "buffers over NVLink; no multicast) for bf16 / fp16 tensors up to 4 MiB (decode steps), NCCL above; "
         "symm_mem_norm = symm_mem, and each sum that a residual add + RMSNorm follows (all of them in Qwen3.5 / "
         "Qwen3) is one Triton kernel that sums over the peers' buffers, adds and norms (three kernels apart); "
         "auto = symm_mem_norm where the ranks' GPUs have peer access to each other and the model is bf16 / fp16, "
         "nccl elsewhere. The symm_mem modes are CUDA only: elsewhere they have no effect (with a warning). "
         "Measured: notes/gpu-2026-11-30-tp2-9b.md (symm_mem), notes/gpu-2026-12-01-allreduce-norm.md "
         "(symm_mem_norm).",
         choices=("nccl", "symm_mem", "symm_mem_norm", "auto")),
    Knob("MSTAR_DIT_GRAPHS", "int", 4,
         "Denoising transformers (Wan, Cosmos3) replay each step as a CUDA graph, captured per batch shape on the shape's "
         "second step (the first runs eagerly); this many shapes are kept, least recently used dropped. "
         "0: every step eager. Steps with per-token timesteps (image to video) always run eagerly. "
         "The same kernels either way, so the same outputs. Measured: notes/gpu-2026-12-03-video.md.",
         minimum=0),
    Knob("MSTAR_DIT_COMPILE", "bool", False,
         "Denoising transformers (Wan, Cosmos3) run their step through torch.compile (Inductor, static shapes: "
         "one compile per batch shape, on its first step), which fuses the norms, rotary, gates and residual adds "
         "between the matmuls and attention ops; the step graphs (MSTAR_DIT_GRAPHS) then capture the compiled "
         "step. Off: the eager step (bit-identical outputs to a build without this knob). "
         "tests/test_dit_compile.py checks the compiled step against the eager one."),
    Knob("MSTAR_DIT_FP8", "bool", False,
         "Denoising transformers (Wan, Cosmos3) run their blocks' linear layers in float8 e4m3 on the float8 tensor "
         "cores (sm89 and newer): weights quantized at load with a scale per output row, activations per token at "
         "each call (one Triton kernel, the MLP's activation inside it). Wan: every block projection but the "
         "text's keys / values; Cosmos3: the generation tower's. Lossy: tests/test_fp8_models.py bounds the "
         "step's error, and a request's pixels may move with what it is batched with. Off: bfloat16, "
         "bit-identical to a build without this knob. On an H100 the Wan 832x480x33 step took 23% less time, the "
         "Cosmos3 832x480x93 step 16% less (notes/dit-fp8.md)."),
    Knob("MSTAR_VAE_DTYPE", "choice", "auto",
         "The Wan2.2 VAE's dtype (Wan, Cosmos3: the decode of every generation, the encode of an image to video). "
         "auto: each family as its diffusers pipeline is set up: Wan float32 (the Wan2.2 pipelines load their VAE "
         "in float32), Cosmos3 the pipeline's dtype (Cosmos3OmniPipeline loaded with one torch_dtype). bfloat16 "
         "runs the convolutions at the bf16 matrix rate, about 1.4% relative error in the pixels "
         "(tests/test_vae_dtype.py bounds it): an 832x480x33 decode 1.03 -> 0.52 s on an H100 "
         "(notes/denoise-levers.md).",
         choices=("auto", "float32", "bfloat16")),
    Knob("MSTAR_VAE_CHANNELS_LAST", "bool", True,
         "The Wan2.2 VAE's convolution weights and decode activations in channels_last_3d ([B, T, H, W, C] "
         "memory), the layout cuDNN's tensor-core convolutions read without transposing: the same function "
         "(tests/test_vae_decode_options.py), 3-4% faster decodes on an H100 (notes/denoise-levers.md). Off: "
         "the contiguous layout."),
    Knob("MSTAR_TTS_FRAME_GRAPHS", "bool", True,
         "Qwen3-TTS on CUDA replays each frame (the talker's decode, the code predictor's 15 steps and their "
         "sampling) as one CUDA graph, captured per padded batch size (1, 2, 4, then multiples of 8) on its first "
         "use; off: every frame eager (about a thousand kernel launches). The same inputs either way: "
         "tests/test_qwen3_tts_talker.py checks the graphs' buffers and padding against the eager step. "
         "Measured: notes/gpu-2026-12-04-qwen3-tts-graphs.md."),
    Knob("MSTAR_TTS_CODEC_GRAPHS", "bool", False,
         "Qwen3-TTS on CUDA replays each codec chunk from a CUDA graph per shape: the chunk's streams padded to "
         "1, 2, 4 or a multiple of 8 (padding rows decode from an empty state slot), its frames to a chunk size. "
         "Each stream's samples are the eager chunk's within float rounding (a padded batch may run other "
         "kernels; tests/test_qwen3_tts_codec.py checks the padding on CPU). Off by default until a GPU run measures it (the eager chunk takes 21-28 ms: "
         "notes/gpu-2026-12-04-qwen3-tts-graphs.md)."),
    Knob("MSTAR_SNAC_GRAPHS", "bool", True,
         "Orpheus on CUDA decodes each step's SNAC windows from a CUDA graph per padded window count (1, 2, 4 "
         "or a multiple of 8; padding windows of code 0), on a CUDA stream of the codec's own, so the windows "
         "decode beside the LM's next step instead of behind it; off: the windows as they come, eagerly, on the "
         "default stream. Each window's samples are the eager forward's within float rounding (tests/test_snac.py "
         "checks the padding on CPU). Measured: notes/orpheus-first-audio.md."),
    Knob("MSTAR_CANDIDATE_SAMPLING", "bool", True,
         "A step whose sampled rows are all media requests of a family that lists each row's candidate tokens "
         "(Orpheus: the frame position's 4096 audio codes, and end of speech at a frame start) samples on those "
         "columns alone: the head's logits gathered to [rows, candidates], the penalties and the draw (one stable "
         "sort) at that width, instead of a vocabulary-wide mask, top-k and two sorts. The noise is keyed on the "
         "token id and the kept set is the same, so the tokens are the whole-vocabulary path's (off) except within float "
         "rounding of a top-p boundary (the softmax sums over another width); tests/test_orpheus.py checks them "
         "equal. Measured: notes/orpheus-first-audio.md."),
    Knob("MSTAR_LOG_LEVEL", "choice", "info", "Logging level of mstar's loggers.",
         choices=("debug", "info", "warning", "error")),
    Knob("MSTAR_MODEL_PLUGINS", "str", "",
         "Comma-separated Python modules imported at the first model lookup; each registers model families "
         "(mstar.models.registry.register). Empty: the built-in families only."),
    Knob("MSTAR_API_KEY", "str", "",
         "The API key the server requires (Authorization: Bearer KEY) when neither --api-key nor --api-key-file "
         "is given; unlike --api-key it does not show in the process list. Empty: no key."),
    # --- diagnostics -----------------------------------------------------------------------
    Knob("MSTAR_PHASE_TIMING", "bool", False,
         "Record per-step phase times (schedule, prepare, plan, forward, logits, sample, output, idle gap "
         "between steps) as JSON lines to MSTAR_PHASE_LOG; summarise with `python -m mstar.bench.tools.phase_idle` (notes/phase_timing.md). "
         "On CUDA it synchronizes after the forward and the logits (off: no timing code, no syncs)."),
    Knob("MSTAR_PHASE_LOG", "str", "phase_timing.jsonl",
         "Where MSTAR_PHASE_TIMING appends its JSON lines (relative paths: the working directory). "
         "Empty: stderr."),
)

_BY_NAME: dict[str, Knob] = {k.name: k for k in KNOBS}
# Set by other tools in the MSTAR_ namespace that are not knobs of this process.
_FOREIGN: frozenset[str] = frozenset()

_values: dict[str, Any] | None = None
_overrides: list[dict[str, Any]] = []


def parse_environment(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Parse every knob from `environ`; raise KnobError naming the first bad one."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for name in sorted(env):
        if name.startswith("MSTAR_") and name not in _BY_NAME and name not in _FOREIGN:
            raise KnobError(f"{name}: unknown knob (see `python -m mstar.runtime.knobs`)")
    for knob in KNOBS:
        raw = env.get(knob.name)
        out[knob.name] = knob.default if raw is None else knob.parse(raw)
    return out


def value(name: str) -> Any:
    """The knob's value for this process (parsed once, on first use)."""
    global _values
    for layer in reversed(_overrides):
        if name in layer:
            return layer[name]
    if _values is None:
        _values = parse_environment()
    try:
        return _values[name]
    except KeyError:
        raise KnobError(f"{name}: unknown knob") from None


def changed() -> dict[str, Any]:
    """The knobs this process runs with that differ from their defaults (benchmark records name
    them, so a figure says which configuration it measured)."""
    return {k.name: v for k in KNOBS if (v := value(k.name)) != k.default}


def reload(environ: dict[str, str] | None = None) -> None:
    """Re-read the environment (tests; a server re-reading after argument parsing)."""
    global _values
    _values = parse_environment(environ)
    for hook in _reload_hooks:
        hook()


_reload_hooks: list[Callable[[], None]] = []


def on_change(hook: Callable[[], None]) -> None:
    """Register a callback run when knob values change (reload or override)."""
    _reload_hooks.append(hook)


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Temporarily set knobs by name, e.g. `override(MSTAR_VERIFY=True)` (tests)."""
    for name, v in values.items():
        if name not in _BY_NAME:
            raise KnobError(f"{name}: unknown knob")
        knob = _BY_NAME[name]
        if isinstance(v, str) and knob.type != "str":
            values[name] = knob.parse(v)
    _overrides.append(dict(values))
    for hook in _reload_hooks:
        hook()
    try:
        yield
    finally:
        _overrides.pop()
        for hook in _reload_hooks:
            hook()


def table_rows() -> list[tuple[str, str, str, str]]:
    rows = []
    for k in KNOBS:
        default = k.default
        if isinstance(default, bool):
            default = int(default)
        dflt = repr(default) if isinstance(default, str) else str(default)
        typ = k.type if not k.choices else f"{k.type}: {'/'.join(map(str, k.choices))}"
        rows.append((k.name, typ, dflt, k.meaning))
    return rows


def format_table(markdown: bool = False) -> str:
    rows = table_rows()
    if markdown:
        lines = ["| knob | type | default | meaning |", "| --- | --- | --- | --- |"]
        lines += [f"| `{n}` | {t} | `{d}` | {m} |" for n, t, d, m in rows]
        return "\n".join(lines)
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    head = ("knob", "type", "default", "meaning")
    w = [max(w[i], len(head[i])) for i in range(3)]
    lines = ["  ".join(head[i].ljust(w[i]) for i in range(3)) + "  " + head[3]]
    for r in rows:
        lines.append("  ".join(r[i].ljust(w[i]) for i in range(3)) + "  " + r[3])
    return "\n".join(lines)
