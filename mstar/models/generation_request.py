"""What every denoising pipeline (Wan, Cosmos3) does alike with a generation request: read and
check its fields, draw its initial noise as diffusers does, and turn the VAE's output into the
typed outputs (an Image, or VideoFrames).

Fields (MediaRequest.inputs, as the image / video routes pass them): prompt (required),
negative_prompt ("" when absent), width + height (one of the pipeline's sizes; both absent: the
mode's default size), num_frames (absent: an image; given: a video, even of one frame), fps,
num_inference_steps, guidance_scale, flow_shift. A wrong field raises ValueError("field: message").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from mstar.models import interfaces as I
from mstar.models.host_copy import to_device


def field_error(field: str, msg: str) -> ValueError:
    return ValueError(f"{field}: {msg}")


def number(inputs: dict, name: str, default, kind=float):
    """inputs[name] as a finite float (or an integer-valued int with kind=int); default when absent."""
    v = inputs.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
        raise field_error(name, f"must be a finite number, got {v!r}")
    if kind is int:
        if float(v) != int(v):
            raise field_error(name, f"must be an integer, got {v!r}")
        return int(v)
    return float(v)


def parse_size(size: str) -> tuple[int, int]:
    """"WxH" -> (W, H)."""
    w, h = (int(v) for v in size.split("x"))
    return w, h


@dataclass
class GenerationFields:
    """The fields every denoising request has, checked."""
    prompt: str
    negative_prompt: str
    width: int
    height: int
    num_frames: int  # as asked (1 for an image)
    video: bool  # VideoFrames out (num_frames given), else an Image
    fps: float
    steps: int
    guidance: float
    flow_shift: float | None  # None: the pipeline's scheduler default


@dataclass
class FieldLimits:
    """What a pipeline takes. defaults(video) -> (size "WxH", steps, guidance) of that mode."""
    sizes: tuple[str, ...]
    max_frames: int
    fps: float
    max_steps: int
    max_input_chars: int
    defaults: Callable[[bool], tuple[str, int, float]]
    flow_shift: float | None = None


def read_fields(inputs: dict, limits: FieldLimits, cls=GenerationFields):
    """The request's common fields, each checked (the module docstring), as a `cls` (a
    GenerationFields, or a subclass of it that adds only properties)."""
    prompt, neg = inputs.get("prompt"), inputs.get("negative_prompt")
    if not isinstance(prompt, str):
        raise field_error("prompt", "a text prompt is required")
    neg = "" if neg is None else neg
    if not isinstance(neg, str):
        raise field_error("negative_prompt", "must be a string")
    for name, text in (("prompt", prompt), ("negative_prompt", neg)):
        if len(text) > limits.max_input_chars:
            raise field_error(name, f"{len(text)} characters; at most {limits.max_input_chars}")
    n = number(inputs, "num_frames", None, int)
    video = n is not None
    size, steps, guidance = limits.defaults(video)
    w, h = number(inputs, "width", None, int), number(inputs, "height", None, int)
    if w is None or h is None:
        w, h = parse_size(size)
    if f"{w}x{h}" not in limits.sizes:
        raise field_error("size", f"{w}x{h} is not supported by this model; use one of {', '.join(limits.sizes)}")
    n = 1 if n is None else n
    if not 1 <= n <= limits.max_frames:
        raise field_error("num_frames", f"{n} frames; this model makes 1 to {limits.max_frames}")
    fps = number(inputs, "fps", limits.fps)
    if not fps > 0:
        raise field_error("fps", f"must be positive, got {fps:g}")
    steps = number(inputs, "num_inference_steps", steps, int)
    if not 1 <= steps <= limits.max_steps:
        raise field_error("num_inference_steps", f"must be in [1, {limits.max_steps}], got {steps}")
    g = number(inputs, "guidance_scale", guidance)
    if g < 0:
        raise field_error("guidance_scale", f"must be >= 0, got {g:g}")
    shift = number(inputs, "flow_shift", limits.flow_shift)
    if shift is not None and not shift > 0:
        raise field_error("flow_shift", f"must be positive, got {shift:g}")
    return cls(prompt, neg, w, h, n, video, fps, steps, g, shift)


def initial_noise(shape: tuple[int, ...], seed: int, device) -> torch.Tensor:
    """diffusers' prepare_latents with generator=torch.Generator().manual_seed(seed): float32 noise
    drawn on the CPU, then moved to the device."""
    g = torch.Generator().manual_seed(int(seed))
    return to_device(torch.randn(shape, generator=g, dtype=torch.float32), device)


def media_outputs(video: torch.Tensor, fields: list) -> list[list]:
    """VAE output [B, 3, F, H, W] in [-1, 1] -> per request [VideoFrames] (fields[b].video) or
    [Image]: pixels (v / 2 + 0.5).clamp(0, 1) as float32, * 255 rounded (half to even) to uint8
    (diffusers' np output and its numpy_to_pil rounding). fields[b] has `video` and `fps`. The
    pixels are made where the video is (a quarter of the float32 bytes cross to the host, and the
    GPU does the arithmetic): the same IEEE float32 operations as numpy's, so the same bytes."""
    px = (video * 0.5 + 0.5).clamp(0, 1).float()
    frames = (px * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1).contiguous().cpu().numpy()  # [B, F, H, W, 3]
    return [[I.VideoFrames(f, p.fps)] if p.video else [I.Image(f[0].copy())] for p, f in zip(fields, frames)]


__all__ = ["field_error", "number", "parse_size", "GenerationFields", "FieldLimits", "read_fields", "initial_noise",
           "media_outputs"]
