"""A decoder-only LM's forward cut at its mixer cores, for the runtime's piecewise prefill
graphs (runtime/graphs/prefill_graphs.py): the runtime captures the row-wise segments between
the cores and runs the cores (attention over the paged cache, GDN's conv and recurrence: what
reads a step's metadata) eagerly. The runtime sees only this object, not the model's layers.

A decoder layer is norm -> mixer -> norm -> MLP, and a mixer splits into `pre` (its input
projections), `core` and `post` (its output projection). With L layers there are L cores and
L + 1 segments:

    segment 0:   embed, layer 0's input norm, layer 0's pre
    segment k:   layer k-1's post, its post-attention norm and MLP, layer k's input norm and pre
    segment L:   layer L-1's post, norm and MLP, the final norm
"""

from __future__ import annotations

import torch


class DecoderSegments:
    def __init__(self, model):
        tm = model.model
        self.embed, self.norm, self.rope = tm.embed_tokens, tm.norm, model.rope
        self.layers = list(tm.layers)
        self.num_cores = len(self.layers)
        self.hidden_size = int(tm.norm.weight.shape[0])

    @staticmethod
    def unsupported(model) -> str | None:
        """None if the model can be cut, else why not."""
        tm = getattr(model, "model", None)
        layers = getattr(tm, "layers", None)
        if layers is None or getattr(model, "rope", None) is None:
            return f"{type(model).__name__} is not a decoder-only LM"
        for layer in layers:
            m = layer.mixer
            if not all(hasattr(m, a) for a in ("pre", "core", "post", "core_width")):
                return f"{type(m).__name__} has no pre / core / post"
        return None

    def pre_outputs(self, k: int, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Core k's inputs for hidden rows x (what the runner sizes its buffers from)."""
        return tuple(self.layers[k].mixer.pre(x))

    def core_width(self, k: int) -> int:
        return int(self.layers[k].mixer.core_width())

    def segment(self, k: int, ids: torch.Tensor | None, core_out: torch.Tensor | None,
                residual: torch.Tensor | None):
        """Segment k: from the token ids (k = 0) or core k-1's output and the residual stream, to
        (core k's inputs, the residual) for k < L, or (the final hidden states, None) for k = L."""
        if k == 0:
            h, residual = self.embed(ids), None
        else:
            prev = self.layers[k - 1]
            h = prev.mixer.post(core_out)
            x, residual = prev.post_attention_layernorm.add_forward(h, residual)
            h = prev.mlp(x)
        if k == self.num_cores:
            out, _ = self.norm.add_forward(h, residual)
            return out, None
        layer = self.layers[k]
        x, residual = layer.input_layernorm.add_forward(h, residual)
        return tuple(layer.mixer.pre(x)), residual

    def core(self, k: int, ctx, pre: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Core k over the step's rows (GDN's core takes the rope and ignores it)."""
        return self.layers[k].mixer.core(ctx, pre, self.rope)
