"""lean_import: one module of a package without the package's __init__, and torch.compiler.disable
skipped while it loads (how the fla backend imports fla-core). A throw-away package stands in for
the library: its __init__ would record that it ran and import a heavy sibling."""

import sys
import textwrap
import uuid

import pytest
import torch

from mstar.ops.backends.lean_import import import_lean


@pytest.fixture()
def lib(tmp_path, monkeypatch):
    name = f"lib_{uuid.uuid4().hex[:8]}"
    root = tmp_path / name
    (root / "ops" / "wanted").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "heavy.py").write_text("LOADED = True\n")
    (root / "ops" / "__init__.py").write_text(f"from {name} import heavy\nRAN = True\n")
    (root / "ops" / "wanted" / "__init__.py").write_text("from .impl import f\n")
    (root / "ops" / "wanted" / "impl.py").write_text(textwrap.dedent("""
        import torch

        def _f(x):
            return x + 1

        f = torch.compiler.disable(_f)
        g = torch.compiler.disable(recursive=False)(_f)
        UNWRAPPED = f is _f and g is _f
    """))
    (root / "ops" / "broken").mkdir()
    (root / "ops" / "broken" / "__init__.py").write_text("raise ImportError('broken on purpose')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[m]


def test_the_module_loads_without_its_packages_init(lib):
    real_disable = torch.compiler.disable
    mod = import_lean(f"{lib}.ops.wanted", bare=(f"{lib}.ops",), skip_compiler_disable=True)
    assert mod.f(torch.tensor(1)).item() == 2
    assert sys.modules[f"{lib}.ops.wanted.impl"].UNWRAPPED  # the disable was skipped while it loaded...
    assert torch.compiler.disable is real_disable  # ...and is torch's own again
    assert f"{lib}.heavy" not in sys.modules and not hasattr(sys.modules[f"{lib}.ops"], "RAN")
    assert import_lean(f"{lib}.ops.wanted", bare=(f"{lib}.ops",)) is mod  # the second call finds it


def test_without_skipping_the_disable_wraps(lib):
    import_lean(f"{lib}.ops.wanted", bare=(f"{lib}.ops",))
    assert not sys.modules[f"{lib}.ops.wanted.impl"].UNWRAPPED


def test_a_failed_import_leaves_no_bare_package_behind(lib):
    real_disable = torch.compiler.disable
    with pytest.raises(ImportError, match="broken on purpose"):
        import_lean(f"{lib}.ops.broken", bare=(f"{lib}.ops",), skip_compiler_disable=True)
    assert f"{lib}.ops" not in sys.modules and torch.compiler.disable is real_disable
    import importlib
    assert importlib.import_module(f"{lib}.ops").RAN  # a plain import now runs the __init__


def test_a_package_already_imported_is_left_as_it_is(lib):
    import importlib
    ops = importlib.import_module(f"{lib}.ops")  # its __init__ runs here
    assert import_lean(f"{lib}.ops.wanted", bare=(f"{lib}.ops",)).f(torch.tensor(2)).item() == 3
    assert sys.modules[f"{lib}.ops"] is ops and ops.RAN


def test_bare_needs_a_package(lib):
    with pytest.raises(ImportError, match="not a package"):
        import_lean(f"{lib}.ops.wanted", bare=(f"{lib}.heavy",))
