"""The model's forward under torch.compile (Inductor), shape-dynamic in the token count.

mstar's ops are `torch.library` custom ops with fake implementations, so Dynamo records
each attention, GDN, KV and norm op as one opaque node and Inductor fuses the torch code
between them (projections' epilogues, gates, softplus / exp of the GDN decay, residual
adds). One compiled graph serves every token count (dynamic=True); Dynamo recompiles
only for the few specialisations it guards on (decode-only, prefill-only and mixed steps,
0 / 1 rows). Compiling costs seconds to a minute on the first call of each kind; the
Inductor and Triton caches under kernel_cache/ make later processes start warm. Decode
graphs (cuda_graphs.py) capture the compiled forward, so their kernels are the fused ones.
"""

from __future__ import annotations

import logging
import time


log = logging.getLogger("mstar.runtime")

# recompiles per code object: a handful of step kinds, well under this
_CACHE_SIZE_LIMIT = 64


class CompiledForward:
    def __init__(self, model):
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, _CACHE_SIZE_LIMIT)
        self.model = model
        self._fn = torch.compile(model.forward, dynamic=True)
        self._kinds: set[tuple[bool, bool]] = set()
        self.compile_s = 0.0

    def __call__(self, ctx):
        kind = (ctx.num_decode_tokens > 0, ctx.num_tokens > ctx.num_decode_tokens)
        if kind in self._kinds:
            return self._fn(ctx)
        t0 = time.perf_counter()  # first call of this kind: compiles
        out = self._fn(ctx)
        self._kinds.add(kind)
        dt = time.perf_counter() - t0
        self.compile_s += dt
        log.info("compiled forward (%s): first call %.1f s", "+".join(n for n, k in zip(("decode", "prefill"), kind)
                                                                       if k), dt)
        return out
