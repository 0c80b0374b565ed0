#!/usr/bin/env bash
# CuTe kernels on the H200: correctness + CUDA graphs, per-kernel compile vs load time, and the
# op-bench rows for the norm / GDN decode backends (cute beside triton / fla / reference).
#
# Run from a checkout on the GPU host, with kernel_cache/ brought over from the build machine
# (built there by `python -m mstar.ops.cache build --preset qwen3.5-0.8b --preset qwen3.5-4b
#  --preset qwen3-0.6b --bench` and moved with `mstar cache export` / `import`; a GPU host without
#  the CuTe DSL cannot compile them, only load them):
#
#   bash mstar/bench/tools/gpu_cute_check.sh
#
# Output: pytest summary of tests/test_gpu_cute.py; a table per kernel with the compile time
# recorded at build (CPU machine) and, measured here in one fresh process, tvm-ffi import,
# runtime-library load, module load, first call (CUDA module load + launch) and steady call time;
# then the bench rows. Exit status: pytest's.
set -uo pipefail
cd "$(dirname "$0")/../../.."
echo "== environment"; python -c "import torch, tvm_ffi; print('torch', torch.__version__, 'tvm_ffi', tvm_ffi.__version__, torch.cuda.get_device_name())"
echo "MSTAR_CUTE_RUNTIME_LIB=${MSTAR_CUTE_RUNTIME_LIB:-unset}"
python -c "import importlib.util as u; print('cutlass DSL importable here:', u.find_spec('cutlass') is not None)"
python -c "import torch, tvm_ffi; print('torch passes its stream to tvm-ffi (DLPack exchange API):', hasattr(torch.Tensor, '__dlpack_c_exchange_api__'))"
echo "== cache"; python -m mstar.ops.cache ls
echo "== tests/test_gpu_cute.py"
python -m pytest -q -rs -p no:cacheprovider tests/test_gpu_cute.py 2>&1 | tail -40
rc=${PIPESTATUS[0]}
echo "== per-kernel compile (build host) vs load (here): one fresh process loads every entry in turn"
python - <<'PY'
import json, subprocess, sys
from mstar.ops.cache import store
# one process for all entries (a process per kernel pays ~10 s of torch import each)
CHILD = r'''
import json, sys, time
t0 = time.perf_counter()
import torch
torch.cuda.init()
t1 = time.perf_counter()
import tvm_ffi
t2 = time.perf_counter()
from mstar.ops.cache import cute
cute._ensure_runtime()
t3 = time.perf_counter()
loads = []
for meta in json.loads(sys.argv[1]):
    a = time.perf_counter()
    cute._load(__import__("pathlib").Path(meta["dir"]) / "kernel.so", meta["symbol"])
    loads.append(time.perf_counter() - a)
print(json.dumps({"torch_s": t1 - t0, "tvm_ffi_import_s": t2 - t1, "runtime_lib_s": t3 - t2, "module_load_s": loads,
                  "dsl_imported": "cutlass" in sys.modules}))
'''
entries = []
for e in store.iter_entries():
    if isinstance(e, tuple):
        print("corrupt:", e[0]); continue
    entries.append(e)
arg = json.dumps([{"dir": str(e.dir), "symbol": e.meta["symbol"]} for e in entries])
r = subprocess.run([sys.executable, "-c", CHILD, arg], capture_output=True, text=True)
if r.returncode:
    print("FAILED", r.stderr[-1500:]); sys.exit(0)
m = json.loads(r.stdout.strip().splitlines()[-1])
print(f"fresh process: torch import + CUDA init {m['torch_s']:.2f} s, tvm_ffi import {m['tvm_ffi_import_s']:.3f} s, "
      f"CuTe runtime library {m['runtime_lib_s'] * 1e3:.1f} ms, DSL imported: {m['dsl_imported']}")
print(f"{'kernel':<20} {'spec':<42} {'compile s':>9} {'link s':>7} {'load ms':>8}")
for e, load in zip(entries, m["module_load_s"]):
    p = e.meta["fields"]["params"]
    shape = " ".join(f"{k}={p[k]}" for k in ("hidden", "dk", "dv", "zero_centered", "mode") if k in p)
    c, lk = e.meta["build"].get("compile_s"), e.meta["build"].get("link_s")
    print(f"{e.meta['kernel']:<20} {shape:<42} {c:>9.3f} {lk:>7.3f} {load * 1e3:>8.3f}")
PY
echo "== first call vs steady call (in-process, after load)"
python - <<'PY'
import time, torch
from mstar.ops import registry
from mstar.ops.cache import cute as aot
from mstar.ops.backends import cute_norm as cn, cute_gdn as cg
BF = torch.bfloat16
cases = [
  ("fused_add_rms_norm h1024 bs32", "fused_add_rms_norm", lambda: (torch.randn(32, 1024, dtype=BF, device="cuda"), torch.randn(32, 1024, dtype=BF, device="cuda"), torch.randn(1024, dtype=BF, device="cuda"), 1e-6, True)),
  ("rms_norm h2560 bs128", "rms_norm", lambda: (torch.randn(128, 2560, dtype=BF, device="cuda"), torch.randn(2560, dtype=BF, device="cuda"), 1e-6, True)),
  ("gated_rms_norm d128 rows2048", "gated_rms_norm", lambda: (torch.randn(2048, 128, dtype=BF, device="cuda"), torch.randn(2048, 128, dtype=BF, device="cuda"), torch.randn(128, dtype=BF, device="cuda"), 1e-6)),
  ("gdn_decode bs128 h16", "gdn_decode", lambda: (torch.randn(128, 16, 128, dtype=BF, device="cuda"), torch.randn(128, 16, 128, dtype=BF, device="cuda"), torch.randn(128, 16, 128, dtype=BF, device="cuda"), -torch.rand(128, 16, device="cuda"), torch.rand(128, 16, device="cuda").to(BF), torch.randn(128, 16, 128, 128, device="cuda") * 0.1, torch.arange(128, device="cuda"), 128 ** -0.5)),
]
for label, op, make in cases:
    fn = registry.get(op).backends["cute"].fn
    args = make(); torch.cuda.synchronize()
    t0 = time.perf_counter(); fn(*args); torch.cuda.synchronize(); first = time.perf_counter() - t0
    for _ in range(10): fn(*args)
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(200): fn(*args)
    torch.cuda.synchronize(); steady = (time.perf_counter() - t0) / 200
    print(f"{label:<32} first call {first*1e3:8.2f} ms (includes file load + CUDA module load)   steady {steady*1e6:7.1f} us/call")
print("events:", [(e["kernel"], e.get("source"), e.get("load_s"), e.get("error")) for e in aot.EVENTS])
PY
echo "== op bench: norm + GDN decode rows (all available backends)"
python -m pytest -q -p no:cacheprovider mstar/bench/ops/test_ops.py -k "rms_norm or gdn_decode" 2>&1 | tail -150
exit $rc
