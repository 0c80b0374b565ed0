"""A CUDA graph per input-shape signature of a pure tensor function (a denoising forward).

    graphed = ShapeGraphs(transformer, max_graphs=4)
    out = graphed(latents, timestep, text)      # the first call of a shape runs eagerly, the second
                                                # captures, later ones replay

The function must depend only on its tensor arguments' values (no host reads of them, no
data-dependent shapes) and must not mutate them. Arguments and the output may be tensors or
lists / tuples of them (nested; the structure is part of the signature). A call's output is
cloned out of the graph's static buffers, so it stays valid after the next replay. Arguments on
the CPU, or a disabled instance, run the function eagerly. At most `max_graphs` signatures are kept (least recently used
dropped, with their memory pool): continuous batching changes the batch size as requests join
and leave, and every size is its own graph.

The first call of a signature is eager because it warms the function's own caches (rotary tables,
kernel autotuning, cuDNN plans) outside the capture, where allocations of persistent tensors would
otherwise land in the graph's private pool. `capture_first=True` captures at once instead (after
one eager run of its own on the capture stream): for functions without such caches whose shapes
come and go (a codec's chunk of a varying set of streams).
"""

from __future__ import annotations

import collections
import inspect
from typing import Callable

import torch
from torch.utils import _pytree as pytree

from mstar import knobs

# Dynamo recompiles a denoiser per batch shape (dynamic=False); keep many shapes compiled
_COMPILE_CACHE_LIMIT = 64


def _signature(leaves: list[torch.Tensor], spec) -> tuple:
    return (str(spec),) + tuple((tuple(a.shape), a.dtype, a.device, a.stride()) for a in leaves)


class _Captured:
    __slots__ = ("graph", "inputs", "output")

    def __init__(self, graph, inputs, output):
        self.graph, self.inputs, self.output = graph, inputs, output


class ShapeGraphs:
    def __init__(self, fn: Callable[..., torch.Tensor], *, max_graphs: int = 4, enabled: bool = True,
                 capture_first: bool = False):
        self.fn = fn
        self.max_graphs = int(max_graphs)
        self.enabled = bool(enabled)
        self.capture_first = bool(capture_first)
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
        for dst, src in zip(got.inputs, leaves):
            dst.copy_(src, non_blocking=True)
        got.graph.replay()
        return pytree.tree_map(lambda t: t.clone(), got.output)

    def _capture(self, key: tuple, leaves: list[torch.Tensor], spec) -> _Captured:
        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
        inputs = [a.clone() for a in leaves]
        args = pytree.tree_unflatten(inputs, spec)
        side = torch.cuda.Stream(device=leaves[0].device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # one more eager run on the capture stream (lazy inits there)
            self.fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = self.fn(*args)
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


def denoiser_step(fn: Callable[..., torch.Tensor]) -> ShapeGraphs:
    """A denoising transformer's step as the diffusion pipelines run it: through torch.compile
    (Inductor, static shapes: one compile per batch shape) when MSTAR_DIT_COMPILE is on, then a
    CUDA graph per batch shape (MSTAR_DIT_GRAPHS)."""
    if knobs.value("MSTAR_DIT_COMPILE"):
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, _COMPILE_CACHE_LIMIT)
        compiled = torch.compile(_undecorated(fn), dynamic=False)

        def fn(*args):
            with torch.inference_mode():  # what the step's own decorator did, outside the compiled code
                return compiled(*args)
    graphs = int(knobs.value("MSTAR_DIT_GRAPHS"))
    return ShapeGraphs(fn, max_graphs=max(graphs, 1), enabled=graphs > 0)


__all__ = ["ShapeGraphs", "denoiser_step"]
