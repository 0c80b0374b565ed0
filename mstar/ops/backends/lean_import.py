"""Import the one module a backend needs from a library whose package `__init__` imports all of it.

fla-core's `fla.ops` imports every op family fla has (about forty), `fla.modules` its layers,
and fla's backend dispatcher wraps each op in `torch.compiler.disable`, which imports
torch._dynamo (and sympy) to do so: most of what `import mstar.ops` took on a GPU host, for the
two functions mstar calls (notes/startup.md).

`import_lean(module, bare=..., skip_compiler_disable=True)`:
- each package named in `bare` is registered with its `__path__` but without running its
  `__init__`, so `import pkg.sub` runs only `sub` and what `sub` imports (a package already
  imported, or stood in for by a test, is left as it is);
- while the module loads, `torch.compiler.disable(fn)` returns `fn` unwrapped. mstar calls such
  functions only inside its torch.library ops, which torch.compile treats as opaque, so the
  wrapper would never have anything to disable; code of one's own that torch.compiles a call
  into the library directly should import it the usual way first.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from types import ModuleType


def bare_package(name: str) -> ModuleType:
    """`name` in sys.modules as a package whose `__init__` has not run (see the module docstring)."""
    if name in sys.modules:
        return sys.modules[name]
    parent, _, child = name.rpartition(".")
    if parent:
        importlib.import_module(parent)
    spec = importlib.util.find_spec(name)
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError(f"{name} is not a package")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    if parent:
        setattr(sys.modules[parent], child, mod)
    return mod


@contextlib.contextmanager
def compiler_disable_skipped():
    """Within: torch.compiler.disable returns the function it is given, unwrapped."""
    import torch

    real = torch.compiler.disable

    def passthrough(fn=None, recursive=True, *, reason=None):
        return (lambda f: f) if fn is None else fn

    torch.compiler.disable = passthrough
    try:
        yield
    finally:
        torch.compiler.disable = real


def import_lean(module: str, *, bare: tuple[str, ...] = (), skip_compiler_disable: bool = False) -> ModuleType:
    """`module`, imported with the packages in `bare` left bare (a failed import takes them out
    of sys.modules again, so that a later plain import runs their `__init__`)."""
    if module in sys.modules:
        return sys.modules[module]
    added = [pkg for pkg in bare if pkg not in sys.modules]
    try:
        for pkg in bare:
            bare_package(pkg)
        with compiler_disable_skipped() if skip_compiler_disable else contextlib.nullcontext():
            return importlib.import_module(module)
    except BaseException:
        for name in [m for m in sys.modules if m == module or m.startswith(module + ".")] + added:
            sys.modules.pop(name, None)
        raise
