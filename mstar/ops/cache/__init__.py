"""mstar's persistent compile cache (kernel_cache/ by default; MSTAR_KERNEL_CACHE moves it).

    store.py       the on-disk entries: root, locks, atomic writes, metadata written last
    toolchains.py  Triton / Inductor / FlashInfer caches pointed under the root
    cute.py        CuTe DSL kernels compiled ahead of time and loaded with tvm-ffi only
    __main__.py    `python -m mstar.ops.cache build | ls | export | import | clear`

Importing this package is cheap: no DSL, no tvm-ffi, no Triton.
"""

from mstar.ops.cache.store import enabled, root  # noqa: F401
