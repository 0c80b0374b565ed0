"""The video routes (GENERATES_VIDEO): one request is one engine sequence carrying an
interfaces.MediaRequest, run by the stage engine; its VideoFrames come back on the job and are
encoded as MP4 (H.264, PyAV) here. The fields are OpenAI's video API with vLLM-Omni's diffusion
extensions, so clients and benchmarks carry over:

POST /v1/videos          an async job: the response is its record, {"id", "object": "video",
                         "status": "queued" | "in_progress" | "completed" | "failed", "progress"
                         (0..100: the denoise steps done), "model", "prompt", "size", "seconds",
                         "num_frames", "fps", "created_at", "completed_at", "error", ...}
GET /v1/videos           every job's record ({"object": "list", "data": [...]})
GET /v1/videos/{id}      the record
GET /v1/videos/{id}/content
                         the MP4 (a job not completed: 409 video_not_ready; failed: its error)
DELETE /v1/videos/{id}   cancels a running job (its sequence is aborted in the engine, its memory
                         freed) and forgets it: {"id", "object": "video.deleted", "deleted": true}
POST /v1/videos/sync     the same request, answered with the MP4 itself (a client that goes away
                         aborts it)

Fields: model, prompt (required), negative_prompt, size "WxH" (or width + height; one of
accepts["sizes"]), num_frames or seconds (seconds x fps frames; at most accepts["max_frames"]),
fps, num_inference_steps (1..accepts["max_steps"], else 1..200), guidance_scale (0..20),
flow_shift (0 < x <= 100), seed, input_reference (image-to-video: a base64 image or data URL, or
{"image_url": "data:..."} as image_reference; a model must list accepts["image_input"]), user.
The generation fields that are left out take the model's defaults. A field that is wrong is a 400
in OpenAI's error schema naming it; more than --max-video-jobs unfinished jobs is a 503 with Retry-After.
Finished jobs are kept (with their MP4) until MAX_KEPT newer ones finished, or deleted.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import time
import uuid
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mstar.models import interfaces as I
from mstar.runtime.serving import api_protocol as P
from mstar.runtime.serving.api_checks import check_model
from mstar.runtime.serving.api_media import (MAX_PROMPT_CHARS, _encode, _max_chars, _seed, _size, _text, _typed,
                                             _unknown, collect_media, generation_fields, start_media_job)
from mstar.runtime.serving.api_protocol import APIError, bad

logger = logging.getLogger("mstar.server")

VIDEO_FIELDS = frozenset({"model", "prompt", "negative_prompt", "size", "width", "height", "seconds", "num_frames",
                          "fps", "num_inference_steps", "guidance_scale", "flow_shift", "seed", "input_reference",
                          "image_reference", "user"})
MAX_KEPT = 64  # finished jobs kept with their MP4
MAX_IMAGE_BYTES = 32 << 20
RETRY_AFTER_S = 5


# -- MP4 -----------------------------------------------------------------------------------------
def mp4_bytes(frames: np.ndarray, fps: float) -> bytes:
    """uint8 [F, H, W, 3] RGB as an H.264 MP4 (yuv420p; an odd width or height is padded by one
    edge pixel, as 4:2:0 needs even sizes)."""
    import av
    px = np.ascontiguousarray(frames, dtype=np.uint8)
    if px.ndim != 4 or px.shape[-1] != 3 or not len(px):
        raise ValueError(f"video frames must be [frames, height, width, 3] uint8, got {tuple(px.shape)}")
    ph, pw = px.shape[1] % 2, px.shape[2] % 2
    if ph or pw:
        px = np.pad(px, ((0, 0), (0, ph), (0, pw), (0, 0)), mode="edge")
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
        stream = out.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = px.shape[2], px.shape[1], "yuv420p"
        if codec == "libx264":
            # sliced threads: every core, each frame encoded before the next (frame threads' rate
            # control sees them finish in varying order). cpu-independent: else x264 lets some
            # of its algorithms follow the CPU's instruction set, and the bytes (and pixels) of an
            # encode would depend on the CPU (no cost measurable on 33 frames at 832x480)
            stream.options = {"crf": "18", "preset": "veryfast", "sliced-threads": "1",
                              "x264-params": "cpu-independent=1"}
        for f in px:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()


def _can_encode_mp4() -> bool:
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


# -- fields --------------------------------------------------------------------------------------
def _reference_image(server, body: dict) -> np.ndarray | None:
    ref = body.get("input_reference")
    name = "input_reference"
    if ref is None and body.get("image_reference") is not None:
        name, ref = "image_reference", body["image_reference"]
        if not isinstance(ref, dict) or set(ref) != {"image_url"} or not isinstance(ref["image_url"], str):
            raise bad(name, "Invalid 'image_reference': expected {\"image_url\": \"data:image/...;base64,...\"}.",
                      "invalid_type")
        ref = ref["image_url"]
    if ref is None:
        return None
    if not server.accepts.get("image_input"):
        raise bad(name, f"Invalid '{name}': this model does not take an image.", "invalid_value")
    if not isinstance(ref, str):
        raise bad(name, f"Invalid '{name}': expected a base64 image or a data URL.", "invalid_type")
    if ref.startswith("data:"):
        head, _, ref = ref.partition(",")
        if not head.endswith(";base64") or not head[5:].startswith("image/"):
            raise bad(name, f"Invalid '{name}': a data URL must be data:image/...;base64,...", "invalid_value")
    if len(ref) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise bad(name, f"Invalid '{name}': the image is over {MAX_IMAGE_BYTES >> 20} MiB.", "invalid_value")
    try:
        raw = base64.b64decode(ref, validate=True)
        from PIL import Image as PILImage
        with PILImage.open(io.BytesIO(raw)) as im:
            return np.asarray(im.convert("RGB"), dtype=np.uint8)
    except ImportError:
        raise bad(name, f"Invalid '{name}': this server cannot decode images (install pillow).",
                  "invalid_value") from None
    except Exception:  # noqa: BLE001 -- not base64, or not an image PIL reads
        raise bad(name, f"Invalid '{name}': not a PNG / JPEG / WebP image in base64.", "invalid_value") from None


def parse_video(server, body: dict) -> tuple[dict, int, dict]:
    """(engine inputs, seed, the record's fields) of a checked request body."""
    _unknown(body, VIDEO_FIELDS)
    model = check_model(server.settings, P._str(body, "model"))
    prompt = _text(body, "prompt", _max_chars(server, MAX_PROMPT_CHARS))
    if body.get("size") is None and (body.get("width") is not None or body.get("height") is not None):
        w, h = P._int(body, "width", None, lo=1), P._int(body, "height", None, lo=1)
        if w is None or h is None:
            raise bad("width" if w is None else "height", "Give both 'width' and 'height' (or 'size').",
                      "missing_required_parameter")
        body = dict(body, size=f"{w}x{h}")
    w, h, size = _size(server, body)
    fps = P._num(body, "fps")
    if fps is not None and not 1 <= fps <= 120:
        raise bad("fps", f"Invalid 'fps': must be in [1, 120], got {fps:g}.", "invalid_value")
    fps = float(fps if fps is not None else server.accepts.get("fps") or 16)
    max_frames = int(server.accepts.get("max_frames") or 256)
    frames = P._int(body, "num_frames", None, lo=1, hi=max_frames)
    seconds = body.get("seconds")
    if isinstance(seconds, str):  # OpenAI's schema sends seconds as a string ("4")
        try:
            body = dict(body, seconds=float(seconds))
        except ValueError:
            raise bad("seconds", f"Invalid 'seconds': {seconds!r} is not a number.", "invalid_type") from None
    seconds = P._num(body, "seconds")
    if frames is not None and seconds is not None:
        raise bad("seconds", "Give 'seconds' or 'num_frames', not both.", "invalid_value")
    if frames is None:
        secs = 4.0 if seconds is None else seconds
        frames = round(secs * fps)
        if not 1 <= frames <= max_frames:
            raise bad("seconds", f"Invalid 'seconds': {secs:g} s at {fps:g} fps is {frames} frames; this model "
                                 f"makes 1 to {max_frames}.", "invalid_value")
    P._str(body, "user")
    seed = _seed(body, None)
    inputs = {"prompt": prompt, "width": w, "height": h, "size": size, "num_frames": frames, "fps": fps,
              **generation_fields(server, body)}
    image = _reference_image(server, body)
    if image is not None:
        inputs["image"] = image
    record = {"model": model, "prompt": prompt, "size": size, "num_frames": frames, "fps": fps,
              "seconds": f"{frames / fps:g}"}
    return inputs, seed, record


# -- jobs ----------------------------------------------------------------------------------------
@dataclass
class VideoJob:
    id: str
    record: dict
    status: str = "queued"
    progress: int = 0
    created_at: int = field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    error: dict | None = None
    content: bytes | None = None
    task: asyncio.Task | None = None
    job: object = None  # the api_jobs.Job of its sequence

    def body(self) -> dict:
        return {"id": self.id, "object": "video", **self.record, "status": self.status, "progress": self.progress,
                "created_at": self.created_at, "completed_at": self.completed_at, "error": self.error,
                "media_type": "video/mp4"}


class VideoStore:
    """The server's async video jobs, in creation order."""

    def __init__(self):
        self.jobs: dict[str, VideoJob] = {}

    def unfinished(self) -> int:
        return sum(j.status in ("queued", "in_progress") for j in self.jobs.values())

    def get(self, vid: str) -> VideoJob:
        j = self.jobs.get(vid)
        if j is None:
            raise APIError(404, f"No video job with id '{vid[:64]}'.", param="video_id", code="video_not_found")
        return j

    def forget_old(self) -> None:
        done = [k for k, j in self.jobs.items() if j.status in ("completed", "failed")]
        for k in done[:max(0, len(done) - MAX_KEPT)]:
            del self.jobs[k]


def _store(server) -> VideoStore:
    store = getattr(server, "video_store", None)
    if store is None:
        store = server.video_store = VideoStore()
    return store


def _percent(o) -> int | None:
    p = getattr(o, "progress", None)
    if not p:
        return None
    _, done, steps = p
    return min(99, int(100 * done / max(1, steps)))


async def _frames(server, events, on_progress=None) -> tuple[np.ndarray, float]:
    """The clip of a job's one sequence, from its events (progress reported on the way)."""
    media: list = []
    async for _, o in events:
        media.extend(o.media or ())
        pct = _percent(o)
        if pct is not None and on_progress is not None:
            on_progress(pct)
    clips = _typed(media, I.VideoFrames, "video frames")
    frames = np.concatenate([np.asarray(c.frames) for c in clips])
    return frames, float(clips[0].fps)


async def _run(server, vj: VideoJob) -> None:
    job = vj.job
    last_logged = [0]

    def on_progress(pct: int) -> None:
        vj.status, vj.progress = "in_progress", pct
        if pct >= last_logged[0] + 25:
            last_logged[0] = pct - pct % 25
            logger.info("video %s: %d%% of its denoise steps", vj.id, pct)

    outcome = "error"
    try:
        frames, fps = await _frames(server, job.events(), on_progress)
        vj.status = "in_progress"
        vj.content = await _encode(server, mp4_bytes, frames, fps)
        vj.status, vj.progress, outcome = "completed", 100, "success"
        logger.info("video %s: completed (%d frames)", vj.id, len(frames))
    except asyncio.CancelledError:
        outcome = "aborted"
        raise
    except APIError as e:
        outcome = "error" if e.status >= 500 else "bad_request"
        vj.status, vj.error = "failed", {"code": e.code or "error", "message": e.message, "param": e.param}
    except Exception as e:  # noqa: BLE001 -- a bug while encoding: the job fails, the server lives
        logger.exception("video %s failed", vj.id)
        vj.status, vj.error = "failed", {"code": "internal_error", "message": f"{type(e).__name__}: {e}"[:500]}
    finally:
        job.close(outcome)
        vj.completed_at = int(time.time())
        vj.task = None
        _store(server).forget_old()


def _need_mp4() -> None:
    if not _can_encode_mp4():
        raise APIError(501, "This server cannot encode MP4 (install av: pip install av).", code="not_implemented")


async def create(server, request: Request, body: dict):
    """POST /v1/videos: the job's record, its work started."""
    _need_mp4()
    inputs, seed, record = parse_video(server, body)
    store = _store(server)
    limit = server.settings.max_video_jobs
    if store.unfinished() >= limit:
        raise APIError(503, f"{limit} video jobs are queued or running; try again later.", code="overloaded",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
    job = await start_media_job(server, request, "videos", [(inputs, seed)])
    vj = VideoJob(f"video_{uuid.uuid4().hex[:24]}", record, job=job)
    store.jobs[vj.id] = vj
    vj.task = asyncio.ensure_future(_run(server, vj))
    return JSONResponse(vj.body(), headers={"x-request-id": vj.id})


async def sync(server, request: Request, body: dict):
    """POST /v1/videos/sync: the MP4 itself."""
    _need_mp4()
    inputs, seed, record = parse_video(server, body)
    job = await start_media_job(server, request, "videos", [(inputs, seed)])
    (outs,) = await collect_media(request, job)
    clips = _typed(outs, I.VideoFrames, "video frames")
    frames = np.concatenate([np.asarray(c.frames) for c in clips])
    data = await _encode(server, mp4_bytes, frames, float(clips[0].fps))
    return Response(data, media_type="video/mp4", headers={"x-request-id": f"video-{uuid.uuid4().hex[:16]}",
                                                            "x-num-frames": str(len(frames))})


def listing(server) -> dict:
    data = [j.body() for j in _store(server).jobs.values()]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": False}


def retrieve(server, vid: str) -> dict:
    return _store(server).get(vid).body()


def content(server, vid: str) -> Response:
    vj = _store(server).get(vid)
    if vj.status == "failed":
        err = vj.error or {}
        raise APIError(400, f"The video job failed: {err.get('message', 'unknown error')}", param="video_id",
                       code="video_failed")
    if vj.status != "completed" or vj.content is None:
        raise APIError(409, f"The video is not ready (status {vj.status}, {vj.progress}%).", param="video_id",
                       code="video_not_ready")
    return Response(vj.content, media_type="video/mp4", headers={"x-request-id": vj.id})


def delete(server, vid: str) -> dict:
    store = _store(server)
    vj = store.get(vid)
    if vj.task is not None and not vj.task.done():
        vj.task.cancel()  # its finally closes the job: the sequence is aborted in the engine
    del store.jobs[vid]
    return {"id": vid, "object": "video.deleted", "deleted": True}
