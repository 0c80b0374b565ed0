"""The dependency direction, read from the source: mstar.ops <- mstar.models <- mstar.runtime;
no runtime module imports a model family's package or names a model's layers."""

import ast
import io
import pathlib
import re
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "mstar"
FAMILIES = sorted(p.parent.name for p in (ROOT / "models").glob("*/family.py"))
# attributes of a model's insides the runtime must not reach (it asks the model's interface)
LAYER_NAMES = ("attention_layers", "state_layers", "cross_attention_layers", "embed_tokens", "mixer",
               "input_layernorm", "post_attention_layernorm", "lm_head", "rope")


def _modules(pkg: str):
    """The library modules of a layer (a `__main__.py` is a command line: it sits above every layer)."""
    for path in sorted((ROOT / pkg).rglob("*.py")):
        if path.name != "__main__.py":
            yield path, ast.parse(path.read_text(), str(path))


def _imports(tree: ast.AST) -> set[str]:
    """Every module a file imports (at any depth: lazy imports count), dotted names in full."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_families_found():
    assert {"qwen3", "qwen3_5", "whisper"} <= set(FAMILIES)


@pytest.mark.parametrize("pkg,forbidden", [("ops", ("mstar.models", "mstar.runtime")),
                                           ("models", ("mstar.runtime",))])
def test_lower_layers_do_not_import_upper_ones(pkg, forbidden):
    bad = [f"{path.relative_to(ROOT)}: {m}" for path, tree in _modules(pkg) for m in _imports(tree)
           if m.startswith(forbidden)]
    assert not bad, bad


def test_runtime_imports_no_family():
    fam = tuple(f"mstar.models.{f}" for f in FAMILIES)
    bad = [f"{path.relative_to(ROOT)}: {m}" for path, tree in _modules("runtime") for m in _imports(tree)
           if m in fam or m.startswith(tuple(f + "." for f in fam))]
    assert not bad, bad


def test_runtime_names_no_model_layers():
    bad = []
    for path, tree in _modules("runtime"):
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in LAYER_NAMES:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr")
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value in LAYER_NAMES):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: getattr {node.args[1].value!r}")
    assert not bad, bad


def test_runtime_code_names_no_family():
    """Family names appear in the runtime's comments, docs and messages (as examples), never as
    names in its code."""
    words = {f.lower() for f in FAMILIES} | {"whisper", "qwen"}
    # a short family name ("wan") is a part of many English words ("want"): it must be a whole
    # part of the name (split at underscores and case changes) to count
    short = {w for w in words if len(w) <= 3}
    words -= short
    bad = []
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if t.type != tokenize.NAME:
                continue
            parts = {p.lower() for p in re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|[0-9]+", t.string)}
            if any(w in t.string.lower() for w in words) or parts & short:
                bad.append(f"{path.relative_to(ROOT)}:{t.start[0]}: {t.string}")
    assert not bad, bad


def test_http_front_end_and_engine_config_import_no_torch():
    """The server's HTTP module, the presets and the engine's configuration import without torch
    (the API process builds them; torch, the op layer and the families load where a model is)."""
    import subprocess
    import sys
    code = ("import sys; import mstar.runtime.serving.api_server, mstar.models.presets, mstar.runtime.engine.config; "
            "print(sorted(m for m in ('torch', 'mstar.ops', 'mstar.models.loader', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", r.stdout


def test_api_process_path_imports_no_op_layer():
    """What the server's API process runs before it starts the engine (the name and device checks,
    the engine's configuration) imports no torch, and nothing it runs before and beside the engine
    (also the config check and the tokenizer, which may load torch through transformers) imports
    the op layer (on CUDA: Triton, FlashInfer) or the weight loader: the engine process loads those,
    and loading them here first would only delay the engine's start."""
    import subprocess
    import sys
    code = ("import sys; from mstar.runtime.serving import preflight, serve; "
            "preflight.check_name('wan2.2-ti2v-5b', True); preflight.check_name('cosmos3-edge', True); "
            "preflight.check_device('auto', 1); preflight.check_device('cpu', 1); "
            "args = serve.build_parser().parse_args(['--model', 'qwen3.5-0.8b', '--random-weights']); "
            "config = serve.engine_config(args); assert config.max_num_seqs is None; "
            "assert 'torch' not in sys.modules, 'torch before the engine starts'; "
            "preflight.check_serve('tiny-qwen3.5', False, 'cpu', 1); preflight.check_serve('tiny-orpheus', False, 'cpu', 1); "
            "assert serve.load_tokenizer('tiny-qwen3.5') is not None; "
            "print(sorted(m for m in ('mstar.ops', 'mstar.models.loader', 'mstar.models.base') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", r.stdout
