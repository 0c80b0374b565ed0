"""The image and video routes, and what every media route shares: a request is one or more
engine sequences carrying an interfaces.MediaRequest, run by the stage engine (stage_engine.py);
their typed outputs (Image, VideoFrames) come back on the job and are encoded here. The shared
part (start_media_job, collect_media, the field parsers) also serves POST /v1/audio/speech,
whose route lives in api_speech.py.

POST /v1/images/generations (GENERATES_IMAGES), OpenAI's schema:
    model, prompt (required), n (1..10: n sequences, seeds seed, seed+1, ...), size "WxH" (one
    of accepts["sizes"]; default the first), response_format b64_json (PNG), output_format png,
    seed (default: random), user. Response {"created", "data": [{"b64_json"}, ...]}.
    plus the diffusion controls the video routes take too (generation_fields): negative_prompt,
    num_inference_steps, guidance_scale, flow_shift.
The video routes are in api_video.py.

Errors: a field that is wrong is a 400 in OpenAI's error schema (param names it); a model that
fails on a request is a 500 (internal_error), for that request only. A client that goes away
aborts its sequences in the engine at once.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import re
import secrets
import struct
import time
import uuid
import zlib

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse

from mstar.models import interfaces as I
from mstar.runtime.serving import api_protocol as P
from mstar.runtime.serving.api_checks import check_model
from mstar.runtime.serving.api_jobs import Job, await_job
from mstar.runtime.serving.api_protocol import APIError, bad

logger = logging.getLogger("mstar.server")

IMAGE_FIELDS = frozenset({"model", "prompt", "n", "size", "response_format", "output_format", "seed", "user",
                          "negative_prompt", "num_inference_steps", "guidance_scale", "flow_shift"})
MAX_PROMPT_CHARS = 4000
MAX_IMAGES = 10
MAX_STEPS = 200  # num_inference_steps, unless the model says (accepts["max_steps"])
_SIZE = re.compile(r"^([1-9][0-9]{0,4})x([1-9][0-9]{0,4})$")


# -- encoders ----------------------------------------------------------------------------------
def _png_chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)


def png_bytes(pixels: np.ndarray) -> bytes:
    """uint8 [H, W, 3] RGB as a PNG file (PIL when installed, else written here: 8-bit RGB, no
    filtering, one zlib stream)."""
    px = np.ascontiguousarray(pixels, dtype=np.uint8)
    if px.ndim != 3 or px.shape[2] != 3:
        raise ValueError(f"an image must be [height, width, 3] uint8, got shape {tuple(px.shape)}")
    try:
        import io

        from PIL import Image as PILImage
    except ImportError:
        h, w, _ = px.shape
        rows = np.zeros((h, 1 + 3 * w), dtype=np.uint8)  # a 0 byte (filter: none) before each row
        rows[:, 1:] = px.reshape(h, 3 * w)
        ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
        return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", zlib.compress(rows.tobytes(), 6))
                + _png_chunk(b"IEND", b""))
    buf = io.BytesIO()
    PILImage.fromarray(px, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def _b64_png(pixels: np.ndarray) -> str:
    return base64.b64encode(png_bytes(pixels)).decode("ascii")


# -- fields ------------------------------------------------------------------------------------
def _unknown(body: dict, allowed: frozenset[str]) -> None:
    for k in body:
        if k not in allowed:
            raise bad(k, f"Unrecognized request argument supplied: {k}", "unrecognized_argument")


def _text(body: dict, name: str, limit: int, required: bool = True) -> str | None:
    v = P._str(body, name)
    if v is None:
        if required:
            raise bad(name, f"Missing required parameter: '{name}'.", "missing_required_parameter")
        return None
    if required and not v.strip():
        raise bad(name, f"Invalid '{name}': the text is empty.", "invalid_value")
    if len(v) > limit:
        raise bad(name, f"Invalid '{name}': string too long. Expected a string with maximum length {limit}, "
                        f"but got a string with length {len(v)} instead.", "string_above_max_length")
    return v


def _choice(body: dict, name: str, allowed, default):
    v = P._str(body, name, default)
    if v not in allowed:
        raise bad(name, f"Invalid '{name}': {v!r} is not supported; use one of {', '.join(map(str, allowed))}.",
                  "invalid_value")
    return v


def _seed(body: dict, default: int | None) -> int:
    v = P._int(body, "seed")
    if v is None:
        return secrets.randbits(62) if default is None else default
    return v % P.MAX_SEED


def _size(server, body: dict) -> tuple[int, int, str]:
    sizes = [str(s) for s in server.accepts.get("sizes") or ()]
    v = P._str(body, "size", sizes[0] if sizes else None)
    if v is None or v == "auto":
        if not sizes:
            raise bad("size", "Missing required parameter: 'size' (\"WIDTHxHEIGHT\").", "missing_required_parameter")
        v = sizes[0]
    m = _SIZE.match(v)
    if m is None:
        raise bad("size", f"Invalid 'size': {v!r} is not \"WIDTHxHEIGHT\".", "invalid_value")
    if sizes and v not in sizes:
        raise bad("size", f"Invalid 'size': {v!r} is not supported by this model; use one of {', '.join(sizes)}.",
                  "invalid_value")
    return int(m.group(1)), int(m.group(2)), v


def _max_chars(server, default: int) -> int:
    v = server.accepts.get("max_input_chars")
    return int(v) if isinstance(v, int) and v > 0 else default


def generation_fields(server, body: dict) -> dict:
    """The diffusion controls the image and video routes share; only the given ones (the model
    has its defaults)."""
    out = {}
    neg = _text(body, "negative_prompt", _max_chars(server, MAX_PROMPT_CHARS), required=False)
    if neg is not None:
        out["negative_prompt"] = neg
    steps = P._int(body, "num_inference_steps", None, lo=1, hi=int(server.accepts.get("max_steps") or MAX_STEPS))
    if steps is not None:
        out["num_inference_steps"] = steps
    g = P._num(body, "guidance_scale")
    if g is not None:
        if not 0.0 <= g <= 20.0:
            raise bad("guidance_scale", f"Invalid 'guidance_scale': must be in [0, 20], got {g:g}.", "invalid_value")
        out["guidance_scale"] = g
    s = P._num(body, "flow_shift")
    if s is not None:
        if not 0.0 < s <= 100.0:
            raise bad("flow_shift", f"Invalid 'flow_shift': must be in (0, 100], got {s:g}.", "invalid_value")
        out["flow_shift"] = s
    return out


# -- jobs --------------------------------------------------------------------------------------
async def start_media_job(server, request: Request, endpoint: str, items: list[tuple[dict, int]]) -> Job:
    """Admit a request's media sequences ((inputs, seed) each) and send them to the engine."""
    job = Job(server, endpoint, len(items))
    await server.admission.acquire(job.n_admitted, request)
    try:
        server.check_alive()
        server.submit_media(job, [(i, inputs, seed) for i, (inputs, seed) in enumerate(items)], request.state.arrival)
    except BaseException as e:
        job.close("error" if not isinstance(e, APIError) or e.status >= 500 else "bad_request")
        if isinstance(e, APIError):
            e.counted = True
        raise
    return job


async def collect_media(request: Request, job: Job) -> list[list]:
    """Every sequence's outputs (one list per sequence, in order); the job is closed with its
    outcome (a client that goes away aborts it at once)."""
    outs: list[list] = [[] for _ in range(job.n_admitted)]

    async def collect():
        async for i, o in job.events():
            outs[i].extend(o.media or ())

    await await_job(request, job, collect())
    return outs


def _typed(outs: list, kind: type, what: str) -> list:
    got = [o for o in outs if isinstance(o, kind)]
    if not got:
        raise APIError(500, f"The model returned no {what}.", code="internal_error")
    return got


async def _encode(server, fn, *args):
    """Encoding (PNG, base64) off the event loop."""
    return await asyncio.get_running_loop().run_in_executor(server.pool, fn, *args)


# -- POST /v1/images/generations ---------------------------------------------------------------
async def images(server, request: Request, body: dict):
    _unknown(body, IMAGE_FIELDS)
    model = check_model(server.settings, P._str(body, "model"))
    prompt = _text(body, "prompt", _max_chars(server, MAX_PROMPT_CHARS))
    n = P._int(body, "n", 1, lo=1, hi=MAX_IMAGES)
    w, h, size = _size(server, body)
    _choice(body, "response_format", ("b64_json",), "b64_json")
    _choice(body, "output_format", ("png",), "png")
    P._str(body, "user")
    seed = _seed(body, None)
    extra = generation_fields(server, body)
    items = [({"prompt": prompt, "width": w, "height": h, "size": size, **extra}, (seed + j) % P.MAX_SEED)
             for j in range(n)]
    job = await start_media_job(server, request, "images", items)
    outs = await collect_media(request, job)
    pics = [p for o in outs for p in _typed(o, I.Image, "image")]
    data = [{"b64_json": await _encode(server, _b64_png, p.pixels)} for p in pics]
    return JSONResponse({"created": int(time.time()), "data": data, "size": size, "output_format": "png",
                         "model": model},
                        headers={"x-request-id": f"img-{uuid.uuid4().hex[:16]}"})
