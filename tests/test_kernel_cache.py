"""The on-disk kernel cache (mstar/ops/cache): CuTe kernels built for sm_90a on this CPU machine,
found by a second process without compiling, keyed by every specialization, rebuilt when
corrupt, safe with concurrent builders, and moved through the CLI's export / import."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mstar import knobs
from mstar.ops.cache import cute, store, toolchains

REPO = Path(__file__).resolve().parents[1]
needs_dsl = pytest.mark.skipif(not cute.can_build(), reason="needs nvidia-cutlass-dsl + apache-tvm-ffi + cc "
                               "(pip install -e '.[dev]') to build CuTe kernels")
ARCH = "sm_90a"


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "kc"
    monkeypatch.setenv("MSTAR_KERNEL_CACHE", str(root))
    monkeypatch.delenv("MSTAR_KERNEL_CACHE_DISABLE", raising=False)
    knobs.reload()
    yield root
    monkeypatch.undo()
    knobs.reload()


def _env(root: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MSTAR_")}
    env.update(MSTAR_KERNEL_CACHE=str(root), PYTHONPATH=str(REPO), **extra)
    return env


def _py(root: Path, code: str, **extra) -> dict:
    """Run code in a fresh interpreter; it prints one JSON line last."""
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         env=_env(root, **extra), cwd=str(REPO), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _gated_params(hidden=128):
    from mstar.ops.backends import cute_norm
    return cute_norm.K_GATED, cute_norm.norm_params("gated", hidden, "bfloat16", "bfloat16")


LOAD_SCRIPT = """
    import json, sys
    from mstar.ops.cache import cute
    from mstar.ops.backends import cute_norm
    HIDE_DSL
    fn = cute_norm.K_GATED.get(cute_norm.norm_params("gated", 128, "bfloat16", "bfloat16"), "sm_90a")
    print(json.dumps({"stats": cute.STATS, "fn": fn is not None, "cutlass_imported": "cutlass" in sys.modules,
                      "events": cute.EVENTS}))
"""


# --- CuTe kernels (need the DSL to build) ------------------------------------------------------------
@needs_dsl
def test_build_for_sm90a_on_cpu_and_second_process_loads_without_compiling(cache_root):
    k, p = _gated_params()
    e = k.build(p, ARCH)
    assert (e.dir / "kernel.so").is_file() and (e.dir / store.META).is_file()
    assert e.meta["fields"]["arch"] == ARCH and e.meta["fields"]["params"]["hidden"] == 128
    assert e.meta["fields"]["cutlass_dsl"] and e.meta["fields"]["tvm_ffi"]
    out = _py(cache_root, LOAD_SCRIPT.replace("HIDE_DSL", ""))
    assert out["fn"] and out["stats"]["compiled"] == 0 and out["stats"]["loaded"] == 1
    assert not out["cutlass_imported"], "a warm process must not import the DSL"
    assert out["events"][0]["source"] == "cache" and out["events"][0]["load_s"] < 1.0


@needs_dsl
def test_host_without_dsl_finds_entry_by_spec(cache_root):
    """An offline GPU host has tvm-ffi + the runtime library but no DSL: the DSL version is
    unknown there, so the entry is found by spec id and tvm-ffi version."""
    k, p = _gated_params()
    k.build(p, ARCH)
    hide = "cute.dsl_version = lambda: None; cute.can_build = lambda: False"
    out = _py(cache_root, LOAD_SCRIPT.replace("HIDE_DSL", hide))
    assert out["fn"] and out["stats"]["compiled"] == 0 and not out["cutlass_imported"]


@needs_dsl
def test_changed_specialization_or_toolchain_misses(cache_root, monkeypatch):
    k, p = _gated_params()
    k.build(p, ARCH)
    assert k.find(p, ARCH) is not None
    assert k.find(dict(p, hidden=256), ARCH) is None
    assert k.find(dict(p, dtype="float16"), ARCH) is None
    assert k.find(p, "sm_100a") is None
    keys = {k.key(p, ARCH), k.key(dict(p, z_dtype="float32"), ARCH), k.key(p, "sm_100a")}
    monkeypatch.setattr(cute, "dsl_version", lambda: "0.0.0")
    keys.add(k.key(p, ARCH))
    assert k.find(p, ARCH) is None  # another DSL version: rebuilt, not loaded
    monkeypatch.undo()
    other = cute.CuteKernel(k.name, (__file__,), k.builder)  # another kernel source
    keys.add(other.key(p, ARCH))
    assert len(keys) == 5


@needs_dsl
@pytest.mark.parametrize("damage", ["truncate_so", "flip_so", "bad_meta", "no_meta"])
def test_corrupt_entry_is_rebuilt_not_loaded(cache_root, damage):
    k, p = _gated_params()
    e = k.build(p, ARCH)
    so, meta = e.dir / "kernel.so", e.dir / store.META
    data = so.read_bytes()
    if damage == "truncate_so":
        so.write_bytes(data[: len(data) // 2])
    elif damage == "flip_so":
        so.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    elif damage == "bad_meta":
        meta.write_text("{not json")
    else:
        meta.unlink()
    assert k.find(p, ARCH) is None
    before = cute.STATS["compiled"]
    e2 = k.build(p, ARCH)
    assert cute.STATS["compiled"] == before + 1
    assert store.read_entry(e2.dir, e2.key) is not None and so.read_bytes() == data


@needs_dsl
def test_concurrent_builders_do_not_corrupt(cache_root):
    code = """
        import json
        from mstar.ops.cache import cute
        from mstar.ops.backends import cute_norm
        k, p = cute_norm.K_RMS, cute_norm.norm_params("rms", 384, "bfloat16", "bfloat16", True)
        e = k.build(p, "sm_90a")
        print(json.dumps({"compiled": cute.STATS["compiled"], "key": e.key}))
    """
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_env(cache_root), cwd=str(REPO))
             for _ in range(2)]
    outs = []
    for pr in procs:
        so, se = pr.communicate(timeout=300)
        assert pr.returncode == 0, se[-3000:]
        outs.append(json.loads(so.strip().splitlines()[-1]))
    assert outs[0]["key"] == outs[1]["key"]
    assert sum(o["compiled"] for o in outs) == 1, "the second builder must find the first one's entry"
    entries = [e for e in store.iter_entries(cache_root)]
    assert len(entries) == 1 and not isinstance(entries[0], tuple)
    leftovers = [p.name for p in (cache_root / "cute" / "rms_norm").iterdir() if p.name.startswith(".tmp")]
    assert not leftovers


@needs_dsl
def test_cli_build_ls_export_clear_import_round_trip(tmp_path):
    a, b, arc = tmp_path / "a", tmp_path / "b", tmp_path / "kernels.tar.gz"

    def cli(root, *args):
        res = subprocess.run([sys.executable, "-m", "mstar.ops.cache", "--root", str(root), *args],
                             capture_output=True, text=True, env=_env(root), cwd=str(REPO), timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        return res.stdout

    out = cli(a, "build", "--preset", "tiny-qwen3.5")
    assert "built" in out and "gdn_decode" in out and "gated_rms_norm" in out
    assert "cached" in cli(a, "build", "--preset", "tiny-qwen3.5")
    (a / "triton").mkdir()
    (a / "triton" / "x.cubin").write_bytes(b"abc")
    listing = cli(a, "ls")
    n = sum(1 for line in listing.splitlines() if line.startswith("cute/"))
    assert n >= 4 and "triton/" in listing
    cli(a, "export", str(arc))
    cli(a, "clear")
    assert "0 CuTe kernel entries" in cli(a, "ls")
    out = cli(b, "import", str(arc))
    assert f"{n} CuTe kernel entries" in out and "1 other files" in out
    assert f"{n} CuTe kernel entries" in cli(b, "ls")
    assert (b / "triton" / "x.cubin").read_bytes() == b"abc"
    # the imported entries load in a fresh process without compiling
    code = LOAD_SCRIPT.replace("HIDE_DSL", "").replace('"gated", 128', '"gated", 64')  # tiny-qwen3.5's GDN head dim
    got = _py(b, code)
    assert got["fn"] and got["stats"]["compiled"] == 0


@needs_dsl
def test_disabled_cache_compiles_in_process_and_writes_nothing(cache_root, monkeypatch):
    monkeypatch.setenv("MSTAR_KERNEL_CACHE_DISABLE", "1")
    knobs.reload()
    assert not store.enabled()
    k, p = _gated_params(64)
    before = cute.STATS["compiled"]
    assert k.find(p, ARCH) is None
    assert k.get(p, ARCH) is not None
    assert cute.STATS["compiled"] == before + 1
    assert not (cache_root / "cute").exists()


# --- the store and the toolchain hook (no DSL needed) -----------------------------------------------------
def test_store_entry_roundtrip_and_corruption(cache_root, tmp_path):
    src = tmp_path / "payload.bin"
    src.write_bytes(b"x" * 1000)
    edir = cache_root / "cute" / "k" / "abc"
    with store.locked(edir):
        e = store.write_entry(edir, {"kernel.so": src}, {"key": "abc"})
    assert store.read_entry(edir, "abc").meta["files"]["kernel.so"]["size"] == 1000
    assert store.read_entry(edir, "other") is None
    (edir / "kernel.so").write_bytes(b"y" * 1000)
    assert store.read_entry(edir, "abc") is None
    assert e.size() == 1000


def test_clear_keeps_readme_and_import_refuses_escaping_paths(cache_root, tmp_path):
    import tarfile

    cache_root.mkdir(parents=True)
    (cache_root / "README.md").write_text("keep")
    (cache_root / "triton").mkdir()
    (cache_root / "triton" / "f").write_text("x")
    store.clear()
    assert sorted(p.name for p in cache_root.iterdir()) == ["README.md"]
    bad = tmp_path / "bad.tar.gz"
    with tarfile.open(bad, "w:gz") as tar:
        f = tmp_path / "evil"
        f.write_text("x")
        tar.add(f, arcname="../evil")
    with pytest.raises(ValueError):
        store.import_archive(bad)


def test_toolchain_dirs_under_root(cache_root, monkeypatch):
    for var in toolchains.ENV_DIRS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/else")
    got = toolchains.configure(force=True)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache_root / "inductor")
    assert os.environ["FLASHINFER_WORKSPACE_BASE"] == str(cache_root / "flashinfer")
    assert os.environ["TRITON_CACHE_DIR"] == "/somewhere/else" and "TRITON_CACHE_DIR" not in got
    monkeypatch.setenv("MSTAR_KERNEL_CACHE_DISABLE", "1")
    knobs.reload()
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert toolchains.configure(force=True) == {} and "TORCHINDUCTOR_CACHE_DIR" not in os.environ


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the Triton backends load by design")
def test_importing_ops_does_not_import_heavy_packages():
    code = ("import sys, mstar.ops, mstar.ops.cache.cute; "
            "print([m for m in ('cutlass', 'tvm_ffi', 'triton', 'flashinfer') if m in sys.modules])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(REPO),
                         env={k: v for k, v in os.environ.items() if not k.startswith("MSTAR_")})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


# --- the backends' call glue against the compiled signature (CPU tensors, recorded calls) ----------------
_TORCH_OF = {"BFloat16": torch.bfloat16, "Float16": torch.float16, "Float32": torch.float32,
             "Int64": torch.int64, "Int32": torch.int32}


def _check_call_matches_signature(builder, params, call_args):
    """Every tensor the backend passes has the dtype, rank, static dims and compact strides of the
    fake tensor it was compiled for, symbolic dims are bound consistently, and scalars are numbers."""
    from cutlass.cute.typing import SymInt

    _, fake = builder(dict(params))
    fake = [a for a in fake if type(a).__name__ != "_FakeStream"]  # the stream comes from tvm-ffi's env
    assert len(call_args) == len(fake)
    bound = {}
    for got, want in zip(call_args, fake):
        if not hasattr(want, "shape"):
            assert isinstance(got, (int, float)) and not isinstance(got, bool)
            continue
        assert isinstance(got, torch.Tensor) and got.is_contiguous()
        assert got.dtype == _TORCH_OF[getattr(want.element_type, "__name__", str(want.element_type))]
        assert got.dim() == len(want.shape)
        for n, w in zip(got.shape, want.shape):
            if isinstance(w, SymInt):
                assert bound.setdefault(id(w), n) == n, "a symbolic dim bound to two sizes"
            else:
                assert n == w


@needs_dsl
def test_backend_calls_match_compiled_signatures(monkeypatch):
    from mstar.ops.backends import cute_gdn, cute_norm

    calls = []
    monkeypatch.setattr(cute, "arch_of_device", lambda device=None: ARCH)
    for k in (cute_norm.K_RMS, cute_norm.K_ADD, cute_norm.K_GATED, cute_gdn.K_DECODE):
        monkeypatch.setattr(k, "get", lambda params, arch, k=k: (lambda *a: calls.append((k, params, a))))
    bf = torch.bfloat16
    x, r = torch.randn(5, 3, 256, dtype=bf), torch.randn(5, 3, 256, dtype=bf)
    cute_norm.rms_norm(x, torch.randn(256, dtype=bf), 1e-6, True)
    y, s = cute_norm.fused_add_rms_norm(x[:, 0], r[:, 0], torch.randn(256, dtype=bf), 1e-6, False)
    assert y.shape == s.shape == (5, 256)
    cute_norm.gated_rms_norm(x, r, torch.randn(256, dtype=torch.float32), 1e-6)
    q = torch.randn(4, 16, 128, dtype=bf)
    o = cute_gdn.gdn_decode(q, q.clone(), torch.randn(4, 16, 64, dtype=bf), -torch.rand(4, 16),
                            torch.rand(4, 16).to(bf), torch.zeros(9, 16, 128, 64), torch.tensor([3, 0, 8, 5]),
                            128 ** -0.5)
    assert o.shape == (4, 16, 64) and o.dtype == bf
    assert [c[0].name for c in calls] == ["rms_norm", "fused_add_rms_norm", "gated_rms_norm", "gdn_decode"]
    for k, params, args in calls:
        _check_call_matches_signature(k.builder, params, args)
