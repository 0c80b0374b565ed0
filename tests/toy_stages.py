"""Tiny random torch modules as non-autoregressive families, for the stage engine's tests.

    toy-speech (SYNTHESIZES_SPEECH)   one one-shot stage: text bytes -> embedding (+ voice) -> conv
                                      -> transposed conv -> PCM float32 at 24 kHz, HOP samples per
                                      byte, out in CHUNK-sample AudioChunks
    toy-image (GENERATES_IMAGES, GENERATES_VIDEO)
                                      text encoder (one-shot: the prompt's and the empty prompt's
                                      embeddings) -> denoise loop (FixedStepLoopStage, NUM_STEPS steps
                                      of a conv net on a [frames, 4, H/4, W/4] latent, classifier-free
                                      guidance as doubled batch rows; batch key (size, frames)) ->
                                      decoder (one-shot, transposed conv -> uint8 pixels): an Image, or
                                      VideoFrames when the request asks for frames (/v1/videos)

Weights come from the engine's seed, a latent's noise from the request's seed: the outputs are a
function of (seed, inputs). `reference_speech` / `reference_image` run the same modules by hand,
one request at a time, for the tests to compare with. Test hooks inside the families: a prompt
starting with "slow:" makes every denoise step of its batch sleep SLOW_STEP_S; one starting with
"raise:" makes the loop's start raise.

The Family objects are built here and registered by synthetic_families.py (the plugin module the
server loads through MSTAR_MODEL_PLUGINS), so that importing this module leaves the registry of
the importing process as it is.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from mstar.models import interfaces as I
from mstar.models.presets import Preset
from mstar.models.registry import Family

SAMPLE_RATE = 24000
HOP = 240  # samples per byte of text (10 ms)
CHUNK = 4800  # samples per AudioChunk (0.2 s)
VOICES = ("alloy", "echo")
SIZES = ("32x32", "64x32")
NUM_STEPS = 4
GUIDANCE = 3.0
LATENT = 4  # pixels per latent cell, each way
MAX_FRAMES = 8
FPS = 8.0
SLOW_STEP_S = 0.15


def _seeded(seed: int, build):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def _ids(texts: list[str]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Byte ids [B, T] (0-padded), mask [B, T], lengths."""
    raw = [t.encode("utf-8") for t in texts]
    lens = [len(b) for b in raw]
    T = max(1, max(lens))
    ids = torch.zeros(len(raw), T, dtype=torch.long)
    mask = torch.zeros(len(raw), T)
    for i, b in enumerate(raw):
        if b:
            ids[i, :len(b)] = torch.tensor(list(b), dtype=torch.long)
            mask[i, :len(b)] = 1.0
    return ids, mask, lens


# -- toy-speech ---------------------------------------------------------------------------------
class ToySpeech(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(256, 16)
        self.voice = nn.Embedding(len(VOICES), 16)
        self.conv = nn.Conv1d(16, 16, 3, padding=1)
        self.up = nn.ConvTranspose1d(16, 1, HOP, stride=HOP)

    def forward(self, ids, mask, voice):
        """[B, T] byte ids, [B, T] mask, [B] voice ids -> [B, T * HOP] samples; a row's samples past
        its length * HOP are padding (masked inputs: the kept ones equal an unbatched run's)."""
        m = mask.to(self.embed.weight.dtype)
        e = (self.embed(ids) + self.voice(voice)[:, None]) * m[..., None]
        h = torch.tanh(self.conv(e.transpose(1, 2))) * m[:, None]
        return 0.5 * torch.tanh(self.up(h)).squeeze(1)


def build_speech(seed: int = 0, device="cpu", dtype=torch.float32) -> ToySpeech:
    return _seeded(seed, ToySpeech).to(device=device, dtype=dtype).eval()


def _chunks(pcm: np.ndarray) -> list[I.AudioChunk]:
    n = max(1, -(-len(pcm) // CHUNK))
    return [I.AudioChunk(pcm[i * CHUNK:(i + 1) * CHUNK], SAMPLE_RATE, final=i == n - 1) for i in range(n)]


def speech_pipeline(name_or_dir, dtype=torch.float32, device="cpu", random_weights=False, seed=0,
                    max_batch=None) -> I.Pipeline:
    model = build_speech(seed, device, dtype)

    def run(reqs: list[I.MediaRequest]):
        ids, mask, lens = _ids([r.inputs["text"] for r in reqs])
        voice = torch.tensor([VOICES.index(r.inputs.get("voice") or VOICES[0]) for r in reqs])
        y = model(ids.to(device), mask.to(device), voice.to(device)).float().cpu().numpy()
        return [_chunks(np.ascontiguousarray(y[i, :n * HOP])) for i, n in enumerate(lens)]

    return I.Pipeline([I.OneShotStage(run, max_batch=4)],
                      accepts={"voices": list(VOICES), "max_input_chars": 1000})


def reference_speech(model: ToySpeech, text: str, voice: str = VOICES[0]) -> np.ndarray:
    """The samples of one request, the module run by hand."""
    ids, mask, _ = _ids([text])
    with torch.inference_mode():
        return model(ids, mask, torch.tensor([VOICES.index(voice)])).float().numpy()[0]


# -- toy-image ----------------------------------------------------------------------------------
class ToyTextEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(256, 8)
        self.proj = nn.Linear(8, 16)

    def forward(self, ids, mask):
        m = mask.to(self.embed.weight.dtype)
        e = (self.embed(ids) * m[..., None]).sum(1) / m.sum(1, keepdim=True).clamp(min=1.0)
        return self.proj(e)


class ToyDenoiser(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv_in = nn.Conv2d(4, 16, 3, padding=1)
        self.film = nn.Linear(17, 16)
        self.conv_out = nn.Conv2d(16, 4, 3, padding=1)

    def forward(self, x, t, cond):
        h = self.conv_in(x) + self.film(torch.cat([cond, t[:, None]], 1))[:, :, None, None]
        return self.conv_out(torch.nn.functional.silu(h))


class ToyDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.ConvTranspose2d(4, 3, LATENT, stride=LATENT)

    def forward(self, z):
        """[N, 4, h, w] latents -> [N, h*LATENT, w*LATENT, 3] uint8."""
        px = torch.sigmoid(self.up(z)) * 255.0
        return px.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)


def build_image(seed: int = 0, device="cpu", dtype=torch.float32) -> SimpleNamespace:
    def build():
        return ToyTextEncoder(), ToyDenoiser(), ToyDecoder()
    enc, den, dec = _seeded(seed, build)
    return SimpleNamespace(**{k: m.to(device=device, dtype=dtype).eval()
                              for k, m in (("encoder", enc), ("denoiser", den), ("decoder", dec))})


def _frames(r: I.MediaRequest) -> int:
    return int(r.inputs.get("num_frames") or 1)


def _size_key(r: I.MediaRequest):
    return (int(r.inputs["width"]), int(r.inputs["height"]), _frames(r))


def _noise(r: I.MediaRequest, dtype, device) -> torch.Tensor:
    w, h, f = _size_key(r)
    g = torch.Generator().manual_seed(int(r.seed))
    return torch.randn(f, 4, h // LATENT, w // LATENT, generator=g).to(device=device, dtype=dtype)


def _denoise_step(m, x: torch.Tensor, cond: torch.Tensor, uncond: torch.Tensor, i: int) -> torch.Tensor:
    """One step on latent rows x [N, 4, h, w] with per-row cond / uncond [N, 16]: the guided
    (cond, uncond) pair as 2N rows of one forward."""
    n = x.shape[0]
    t = torch.full((2 * n,), 1.0 - i / NUM_STEPS, dtype=x.dtype, device=x.device)
    eps = m.denoiser(torch.cat([x, x]), t, torch.cat([cond, uncond]))
    ec, eu = eps[:n], eps[n:]
    return x - (eu + GUIDANCE * (ec - eu)) / NUM_STEPS


def image_pipeline(name_or_dir, dtype=torch.float32, device="cpu", random_weights=False, seed=0,
                    max_batch=None) -> I.Pipeline:
    m = build_image(seed, device, dtype)

    def encode(reqs):
        ids, mask, _ = _ids([r.inputs["prompt"] for r in reqs] + [""])
        e = m.encoder(ids.to(device), mask.to(device))
        return [[e[i], e[-1]] for i in range(len(reqs))]

    def start(reqs):
        if any(r.inputs["prompt"].startswith("raise:") for r in reqs):
            raise RuntimeError("the toy denoiser was asked to fail")
        xs = [_noise(r, dtype, device) for r in reqs]
        rows = [x.shape[0] for x in xs]
        cond = torch.cat([r.inputs["previous"][0].expand(n, -1) for r, n in zip(reqs, rows)])
        uncond = torch.cat([r.inputs["previous"][1].expand(n, -1) for r, n in zip(reqs, rows)])
        slow = any(r.inputs["prompt"].startswith("slow:") for r in reqs)
        return {"x": torch.cat(xs), "cond": cond, "uncond": uncond, "rows": rows, "slow": slow}

    def step(state, i):
        if state["slow"]:
            time.sleep(SLOW_STEP_S)
        state["x"] = _denoise_step(m, state["x"], state["cond"], state["uncond"], i)

    def finish(state):
        return [[z] for z in torch.split(state["x"], state["rows"])]

    def decode(reqs):
        zs = [r.inputs["previous"][0] for r in reqs]
        px = m.decoder(torch.cat(zs)).cpu().numpy()
        out, k = [], 0
        for r, z in zip(reqs, zs):
            frames = px[k:k + z.shape[0]]
            k += z.shape[0]
            if r.inputs.get("num_frames"):
                out.append([I.VideoFrames(frames, float(r.inputs.get("fps") or FPS))])
            else:
                out.append([I.Image(frames[0])])
        return out

    return I.Pipeline([I.OneShotStage(encode, max_batch=8),
                       I.FixedStepLoopStage(start, step, finish, lambda state: NUM_STEPS, batch_key=_size_key,
                                            max_batch=4),
                       I.OneShotStage(decode, batch_key=_size_key, max_batch=8)],
                      accepts={"sizes": list(SIZES), "max_input_chars": 200, "max_frames": MAX_FRAMES, "fps": FPS})


def reference_image(m: SimpleNamespace, prompt: str, width: int, height: int, seed: int,
                    num_frames: int | None = None) -> np.ndarray:
    """uint8 [H, W, 3] (or [frames, H, W, 3] with num_frames) of one request, by hand."""
    r = I.MediaRequest("ref", {"prompt": prompt, "width": width, "height": height, "num_frames": num_frames}, seed)
    with torch.inference_mode():
        ids, mask, _ = _ids([prompt, ""])
        e = m.encoder(ids, mask)
        x = _noise(r, torch.float32, "cpu")
        n = x.shape[0]
        for i in range(NUM_STEPS):
            x = _denoise_step(m, x, e[0].expand(n, -1), e[1].expand(n, -1), i)
        px = m.decoder(x).numpy()
    return px if num_frames else px[0]


def _make_config(preset: Preset):
    return SimpleNamespace(model_type=preset.model_type, **preset.config)


SPEECH = Family(
    name="toy_speech", model_types=("toy_speech",), capabilities=frozenset({I.SYNTHESIZES_SPEECH}),
    presets=(Preset("toy-speech", "toy_speech", {"sample_rate": SAMPLE_RATE, "hop": HOP}, embedded=True,
                    note="test family: text -> PCM, random weights"),),
    make_config=_make_config, pipeline=speech_pipeline)

IMAGE = Family(
    name="toy_image", model_types=("toy_image",), capabilities=frozenset({I.GENERATES_IMAGES, I.GENERATES_VIDEO}),
    presets=(Preset("toy-image", "toy_image", {"sizes": list(SIZES), "num_steps": NUM_STEPS}, embedded=True,
                    note="test family: text -> latent denoise loop -> pixels, random weights"),),
    make_config=_make_config, pipeline=image_pipeline)

FAMILIES = (SPEECH, IMAGE)
