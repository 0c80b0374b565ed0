"""`python -m mstar.models info NAME_OR_DIR` : a model's config, layer pattern, size and
cache footprint, computed from shapes (the model is built on the meta device; nothing
full-size is allocated). With `--tp N`, also the per-rank memory plan of tensor parallelism
N (memory_plan.py): weights, KV and state bytes per rank, and how many sequences of
`--context` tokens fit on a GPU of `--gpu-mem-gib`. `python -m mstar.models list` : the presets."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from mstar.models.memory_plan import human_bytes as _human
from mstar.models.context import dtype_name


def _layer_pattern(config) -> str:
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
    letters = "".join({"full_attention": "F", "linear_attention": "L"}.get(t, "?") for t in types)
    # compress a repeating unit: "LLLF" x 6
    for n in range(1, len(letters) + 1):
        if len(letters) % n == 0 and letters[:n] * (len(letters) // n) == letters:
            unit = letters[:n]
            break
    counts = ", ".join(f"{types.count(t)} {t}" for t in dict.fromkeys(types))
    return f"{unit} x {len(letters) // len(unit)}  ({counts}; F = full attention, L = Gated DeltaNet)"


def info(name_or_dir: str, show_config: bool = True) -> str:
    from mstar.models.loader import build_model, resolve_config
    config = resolve_config(name_or_dir)
    model = build_model(config, dtype=torch.bfloat16, device="meta")
    spec = model.cache_spec()
    n = model.num_parameters()
    lines = [f"model: {name_or_dir}  ({type(model).__name__}, model_type {config.model_type})"]
    if show_config:
        lines.append("config: " + json.dumps(config.to_diff_dict() if hasattr(config, "to_diff_dict")
                                             else config.to_dict(), sort_keys=True, default=str))
    lines += [
        f"layers: {_layer_pattern(config)}",
        f"parameters (text model): {n:,} ({n / 1e9:.3f} B); bf16 weights {_human(2 * n)}",
        f"tied embeddings: {model.tie_word_embeddings}; vocab {config.vocab_size}; hidden {config.hidden_size}",
        f"KV cache per token (bf16): {_human(spec.kv_bytes_per_token(torch.bfloat16))} "
        f"over {len(spec.attention)} attention layers",
        f"state per sequence ({'fp32' if spec.state_dtype == torch.float32 else dtype_name(spec.state_dtype)} recurrent state, "
        f"bf16 conv state): "
        f"{_human(spec.state_bytes_per_sequence(torch.bfloat16))} over {len(spec.state)} Gated DeltaNet layers",
        f"eos token ids: {list(model.eos_token_ids)}",
    ]
    if getattr(spec, "cross", None) is not None:  # encoder-decoder (Whisper)
        cb = _human(spec.cross_bytes_per_sequence(torch.bfloat16))
        lines.insert(-1, f"cross-attention K/V per request (bf16): {cb} over {len(spec.cross.layers)} decoder "
                         f"layers x {spec.cross.max_source_len} source positions")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mstar.models", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_info = sub.add_parser("info", help="config, layer pattern, parameter count, cache bytes")
    p_info.add_argument("name_or_dir")
    p_info.add_argument("--no-config", action="store_true", help="do not print the config")
    p_info.add_argument("--tp", type=int, default=None, help="also print the memory plan per rank at this "
                        "tensor-parallel size")
    p_info.add_argument("--gpu-mem-gib", type=float, default=139.0, help="memory per GPU (plan; default 139)")
    p_info.add_argument("--max-num-seqs", type=int, default=128, help="running sequences (plan; default 128)")
    p_info.add_argument("--context", type=int, default=512, help="tokens per sequence (plan; default 512)")
    p_info.add_argument("--reserve-gib", type=float, default=0.0,
                        help="per GPU, not available to the engine: CUDA context, NCCL (plan; default 0)")
    p_info.add_argument("--no-prefix-caching", action="store_true", help="plan without state snapshots")
    sub.add_parser("list", help="the presets")
    args = ap.parse_args(argv)
    if args.cmd == "info":
        print(info(args.name_or_dir, show_config=not args.no_config))
        if args.tp is not None:
            from mstar.models.memory_plan import plan
            try:
                p = plan(args.name_or_dir, args.tp, gpu_mem_gib=args.gpu_mem_gib, max_num_seqs=args.max_num_seqs,
                         context=args.context, reserve_gib=args.reserve_gib,
                         prefix_caching=not args.no_prefix_caching)
            except ValueError as e:  # a tp that cannot split the model, a model without a plan
                ap.error(str(e))
            print("\n".join(p.lines()))
    else:
        from mstar.models import presets
        for name, p in presets.PRESETS.items():
            print(f"{name:16s} {p.model_type:14s} {p.note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
