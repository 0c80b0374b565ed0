"""`python -m mstar.ops.cache`: the kernel cache's command line.

    build   compile every CuTe kernel a preset needs (for sm_90a by default; works on a CPU-only
            machine with nvidia-cutlass-dsl installed), plus the op-bench shapes with --bench
    ls      list entries with sizes, keys and what they were built from
    export  write the cache as one archive (to carry to an air-gapped GPU host)
    import  unpack such an archive into the cache (entries installed whole, verified)
    clear   remove the cache's contents (or one kind: cute, triton, inductor, flashinfer, ...)

The root is MSTAR_KERNEL_CACHE (default ./kernel_cache); --root overrides it for one command.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# kernels the op bench (mstar/bench/ops/cases.py) runs on CUDA: bf16 activations and weights, zero-centred norms
BENCH_HIDDEN = (1024, 2560)
BENCH_GDN = ((128, 128),)


def specs_for(presets: list[str], bench: bool, dtype: str) -> list:
    from mstar.models import presets as P
    from mstar.ops.backends import cute_gdn, cute_norm

    specs = []
    for name in presets:
        pr = P.get(name)
        if pr is None:
            raise SystemExit(f"unknown preset {name!r}; known: {', '.join(P.names())}")
        cfg = dict(pr.config, model_type=pr.model_type)
        specs += cute_norm.preset_specs(cfg, dtype) + cute_gdn.preset_specs(cfg, dtype)
    if bench:
        for h in BENCH_HIDDEN:
            specs.append((cute_norm.K_RMS, cute_norm.norm_params("rms", h, dtype, dtype, True)))
            specs.append((cute_norm.K_ADD, cute_norm.norm_params("add_rms", h, dtype, dtype, True)))
        for dk, dv in BENCH_GDN:
            specs.append((cute_norm.K_GATED, cute_norm.norm_params("gated", dv, dtype, dtype)))
            # mstar/bench/ops/cases.py: g float32, beta in the activation dtype, slots int64
            specs.append((cute_gdn.K_DECODE, cute_gdn.decode_params(dk, dv, dtype, dtype, "float32", dtype)))
    seen, out = set(), []
    for k, p in specs:
        ident = (k.name, tuple(sorted(p.items())))
        if ident not in seen:
            seen.add(ident)
            out.append((k, p))
    return out


def cmd_build(args) -> int:
    from mstar.ops.cache import cute, store

    if not store.enabled():
        print("error: the kernel cache is disabled (MSTAR_KERNEL_CACHE_DISABLE)", file=sys.stderr)
        return 1
    if not cute.can_build():
        print("error: building CuTe kernels needs nvidia-cutlass-dsl, apache-tvm-ffi and a C compiler "
              "(pip install 'nvidia-cutlass-dsl[cu13]' apache-tvm-ffi)", file=sys.stderr)
        return 1
    presets = args.preset or ([] if args.bench else ["qwen3.5-0.8b"])
    specs = specs_for(presets, args.bench, args.dtype)
    t0 = time.perf_counter()
    built = 0
    for k, p in specs:
        had = k.find(p, args.arch) is not None and not args.force
        e = k.build(p, args.arch, force=args.force)
        built += not had
        b = e.meta.get("build", {})
        print(f"{'cached' if had else 'built '}  {k.name:<20} {e.key}  {_human(e.size()):>9}  "
              f"compile {b.get('compile_s', 0):.2f}s  {_params_str(p)}")
    print(f"{len(specs)} kernels for {args.arch} ({built} built) in {time.perf_counter() - t0:.1f}s under "
          f"{store.root()}")
    return 0


def _params_str(p: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(p.items()))


def cmd_ls(args) -> int:
    from mstar.ops.cache import store

    base = store.root()
    print(f"root: {base}{'  (disabled by MSTAR_KERNEL_CACHE_DISABLE)' if not store.enabled() else ''}")
    if not base.is_dir():
        print("(empty)")
        return 0
    n = 0
    for e in store.iter_entries(base):
        if isinstance(e, tuple):
            print(f"cute/{e[0].parent.name}/{e[0].name}  CORRUPT (rebuilt on next use)")
            continue
        f = e.meta.get("fields", {})
        n += 1
        print(f"cute/{e.meta.get('kernel')}/{e.key}  {_human(e.size()):>9}  {f.get('arch')}  "
              f"dsl {f.get('cutlass_dsl')}  tvm-ffi {f.get('tvm_ffi')}  "
              f"compile {e.meta.get('build', {}).get('compile_s', '?')}s  "
              f"{_params_str(f.get('params', {}))}")
    for top in sorted(p for p in base.iterdir() if p.is_dir() and p.name != "cute" and not p.name.startswith(".")):
        size, files = store.dir_size(top)
        print(f"{top.name + '/':<12} {_human(size):>9}  {files} files")
    print(f"{n} CuTe kernel entries")
    return 0


def cmd_export(args) -> int:
    from mstar.ops.cache import store

    files, size = store.export_archive(Path(args.archive), kinds=args.kind or None)
    print(f"wrote {args.archive}: {files} files, {_human(size)} before compression")
    return 0


def cmd_import(args) -> int:
    from mstar.ops.cache import store

    entries, files = store.import_archive(Path(args.archive))
    print(f"imported into {store.root()}: {entries} CuTe kernel entries, {files} other files")
    return 0


def cmd_clear(args) -> int:
    from mstar.ops.cache import store

    removed = store.clear(kinds=args.kind or None)
    print(f"removed {len(removed)} item(s) from {store.root()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mstar.ops.cache",
                                 description="mstar's on-disk compile cache (root: MSTAR_KERNEL_CACHE, "
                                             "default ./kernel_cache).")
    ap.add_argument("--root", help="use this cache root for this command (sets MSTAR_KERNEL_CACHE)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile the CuTe kernels a preset needs into the cache",
                       description="Compile ahead of time every CuTe kernel that a preset calls on CUDA "
                                   "(and the op-bench shapes with --bench). Needs nvidia-cutlass-dsl; no GPU.")
    b.add_argument("--preset", action="append", help="preset name (repeatable; default qwen3.5-0.8b unless --bench)")
    b.add_argument("--bench", action="store_true", help="also the shapes mstar/bench/ops/test_ops.py runs on CUDA")
    b.add_argument("--arch", default="sm_90a", help="target GPU architecture (default sm_90a: H100/H200)")
    b.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="activation and weight dtype (default bfloat16)")
    b.add_argument("--force", action="store_true", help="rebuild even if an intact entry exists")
    b.set_defaults(fn=cmd_build)
    ls = sub.add_parser("ls", help="list entries with sizes and keys",
                        description="List CuTe kernel entries (key, size, arch, toolchain versions, params) "
                                    "and the size of each toolchain cache under the root.")
    ls.set_defaults(fn=cmd_ls)
    ex = sub.add_parser("export", help="write the cache as one archive",
                        description="Write the cache (intact CuTe entries and the toolchain caches, or the "
                                    "kinds named with --kind) to one .tar.gz, to carry to an air-gapped host.")
    ex.add_argument("archive", help="output path, e.g. kernels.tar.gz")
    ex.add_argument("--kind", action="append", help="only this top-level kind (cute, triton, inductor, ...)")
    ex.set_defaults(fn=cmd_export)
    im = sub.add_parser("import", help="unpack an exported archive into the cache",
                        description="Unpack an archive made by `export` into the root: CuTe entries are "
                                    "verified and installed whole, under their locks; other files are copied.")
    im.add_argument("archive", help="path of the archive")
    im.set_defaults(fn=cmd_import)
    cl = sub.add_parser("clear", help="remove the cache's contents",
                        description="Remove everything under the root except README.md (or only --kind).")
    cl.add_argument("--kind", action="append", help="only this top-level kind (cute, triton, inductor, ...)")
    cl.set_defaults(fn=cmd_clear)
    args = ap.parse_args(argv)
    if args.root:
        os.environ["MSTAR_KERNEL_CACHE"] = args.root
        from mstar import knobs

        knobs.reload()
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
