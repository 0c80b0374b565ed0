"""A CUDA graph per input-shape signature of a pure tensor function (a denoising forward).

    graphed = ShapeGraphs(transformer, max_graphs=4)
    out = graphed(latents, timestep, text)      # the first call of a shape runs eagerly, the second
                                                # captures, later ones replay

The function must depend only on its tensor arguments' values (no host reads of them, no
data-dependent shapes) and must not mutate them, except scratch it writes before it reads.
Arguments and the output may be tensors or lists / tuples of them (nested; the structure is part
of the signature); int arguments are part of the signature (a graph per value), not copied. A call's output is
cloned out of the graph's static buffers, so it stays valid after the next replay. Arguments on
the CPU, or a disabled instance, run the function eagerly. At most `max_graphs` signatures are
kept (least recently used dropped, with their memory pool): continuous batching changes the
batch size as requests join and leave, and every size is its own graph.

Every replay copies the arguments into the graph's static inputs. `constant_from=k` declares the
arguments from position k on read-only while the same tensor objects come (a denoiser's text
states or cached prompt keys and values, the same for every step of a batch): such a tensor is
copied only when a different one arrives in its place (held by a weak reference, so a finished
request's memory is not kept alive by the graph).

Also here, for every graph runner (the runtime's decode and prefill graphs, the Qwen3-TTS frame
and codec graphs, the SNAC window graphs): `capture_after_first_use`, the padded batch sizes
(`padded_sizes`, `padded_batch`) and the models' graph modes (`graph_mode`).

The first call of a signature is eager because it warms the function's own caches (rotary tables,
kernel autotuning, cuDNN plans) outside the capture, where allocations of persistent tensors would
otherwise land in the graph's private pool. `capture_first=True` captures at once instead (after
one eager run of its own on the capture stream): for functions without such caches whose shapes
come and go (a codec's chunk of a varying set of streams).
"""

from __future__ import annotations

import collections
import inspect
import weakref
from typing import Callable

import torch
from torch.utils import _pytree as pytree

from mstar import knobs

# Dynamo recompiles a denoiser per batch shape (dynamic=False); keep many shapes compiled
_COMPILE_CACHE_LIMIT = 64


def capture_after_first_use(fn, stream: torch.cuda.Stream, pool=None, on_stream: bool = True):
    """(graph, fn's output in the graph): fn runs once on `stream` first (compiles, autotuning,
    library handles: never inside a capture), then is captured into a new graph, on the same
    stream (on_stream) or on torch.cuda.graph's own capture stream, in `pool` when given."""
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        fn()
    current.wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool, stream=stream if on_stream else None):
        out = fn()
    return g, out


def padded_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch (and max_batch itself)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sorted(set(sizes))


def padded_batch(rows: int, max_batch: int | None = None) -> int:
    """The padded size `rows` runs at: 1, 2, 4, the next multiple of 8, or max_batch when that is
    smaller (padded_sizes(max_batch) holds every answer)."""
    b = rows if rows <= 2 else 4 if rows <= 4 else -(-rows // 8) * 8
    return b if max_batch is None else min(b, max_batch)


def graph_mode(graphs: str, device: torch.device, what: str) -> str:
    """A graph runner's mode: "off" (as calls come), "cuda" (padded shapes replayed from CUDA
    graphs), "static" (the same padding, eagerly: how CPU tests check it); "auto" is "cuda" on a
    CUDA device, else "off". ValueError (naming `what`) for another value, or "cuda" off CUDA."""
    if graphs == "auto":
        graphs = "cuda" if device.type == "cuda" else "off"
    if graphs not in ("off", "cuda", "static"):
        raise ValueError(f"{what}: graphs={graphs!r} (off | cuda | static | auto)")
    if graphs == "cuda" and device.type != "cuda":
        raise ValueError(f"{what}: CUDA graphs on a {device.type} model")
    return graphs


def _signature(leaves: list, spec) -> tuple:
    return (str(spec),) + tuple((tuple(a.shape), a.dtype, a.device, a.stride()) if isinstance(a, torch.Tensor)
                                else ("int", int(a)) for a in leaves)


class _Captured:
    __slots__ = ("graph", "inputs", "output", "sources")

    def __init__(self, graph, inputs, output):
        self.graph, self.inputs, self.output = graph, inputs, output
        self.sources: list = [None] * len(inputs)  # per constant input: a weak reference to its last source

    def load(self, leaves: list[torch.Tensor], variable: int) -> int:
        """Copy the call's leaves into the static inputs: the first `variable` always, a constant
        one only when it is not the tensor copied last time. Returns how many were copied."""
        copied = 0
        for j, (dst, src) in enumerate(zip(self.inputs, leaves)):
            if not isinstance(src, torch.Tensor):  # an int: part of the signature
                continue
            if j >= variable:
                ref = self.sources[j]
                if ref is not None and ref() is src:
                    continue
                self.sources[j] = weakref.ref(src)
            dst.copy_(src, non_blocking=True)
            copied += 1
        return copied


class ShapeGraphs:
    def __init__(self, fn: Callable[..., torch.Tensor], *, max_graphs: int = 4, enabled: bool = True,
                 capture_first: bool = False, constant_from: int | None = None):
        self.fn = fn
        self.max_graphs = int(max_graphs)
        self.enabled = bool(enabled)
        self.capture_first = bool(capture_first)
        self.constant_from = constant_from
        self._graphs: collections.OrderedDict[tuple, _Captured] = collections.OrderedDict()
        self._seen: set[tuple] = set()
        self.captures = 0  # how many graphs were captured (tests and logs read it)

    def __call__(self, *args):
        leaves, spec = pytree.tree_flatten(args)
        if not self.enabled or not leaves or leaves[0].device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return self.fn(*args)
        key = _signature(leaves, spec)
        got = self._graphs.get(key)
        if got is None:
            if key not in self._seen and not self.capture_first:  # first sight: eager, warming the caches
                self._seen.add(key)
                return self.fn(*args)
            got = self._capture(key, leaves, spec)
        else:
            self._graphs.move_to_end(key)
        got.load(leaves, self._variable_leaves(args, leaves))
        got.graph.replay()
        return pytree.tree_map(lambda t: t.clone(), got.output)

    def _variable_leaves(self, args: tuple, leaves: list) -> int:
        """How many leading leaves are copied at every replay (all without constant_from)."""
        if self.constant_from is None:
            return len(leaves)
        return len(pytree.tree_leaves(args[:self.constant_from]))

    def _capture(self, key: tuple, leaves: list[torch.Tensor], spec) -> _Captured:
        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
        inputs = [a.clone() if isinstance(a, torch.Tensor) else a for a in leaves]
        args = pytree.tree_unflatten(inputs, spec)
        # one more eager run on a side stream (lazy inits there), then the capture in its own pool
        graph, output = capture_after_first_use(lambda: self.fn(*args), torch.cuda.Stream(device=leaves[0].device),
                                                on_stream=False)
        got = self._graphs[key] = _Captured(graph, inputs, output)
        self.captures += 1
        return got

    def clear(self) -> None:
        self._graphs.clear()
        self._seen.clear()


def _undecorated(fn: Callable) -> Callable:
    """fn (a module, a bound method or a function) without its decorators (Dynamo cannot trace
    the inference_mode decorator the models' steps carry)."""
    if isinstance(fn, torch.nn.Module):
        return inspect.unwrap(type(fn).forward).__get__(fn)
    if inspect.ismethod(fn):
        return inspect.unwrap(fn.__func__).__get__(fn.__self__)
    return inspect.unwrap(fn)


def denoiser_step(fn: Callable[..., torch.Tensor], constant_from: int | None = None) -> ShapeGraphs:
    """A denoising transformer's step as the diffusion pipelines run it: through torch.compile
    (Inductor, static shapes: one compile per batch shape) when MSTAR_DIT_COMPILE is on, then a
    CUDA graph per batch shape (MSTAR_DIT_GRAPHS); constant_from as ShapeGraphs takes it."""
    if knobs.value("MSTAR_DIT_COMPILE"):
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, _COMPILE_CACHE_LIMIT)
        compiled = torch.compile(_undecorated(fn), dynamic=False)

        def fn(*args):
            with torch.inference_mode():  # what the step's own decorator did, outside the compiled code
                return compiled(*args)
    graphs = int(knobs.value("MSTAR_DIT_GRAPHS"))
    return ShapeGraphs(fn, max_graphs=max(graphs, 1), enabled=graphs > 0, constant_from=constant_from)


__all__ = ["ShapeGraphs", "denoiser_step", "capture_after_first_use", "graph_mode", "padded_sizes", "padded_batch"]
