"""Wan2.2 TI2V generation as three stages of the stage engine: text encoder -> denoise loop -> VAE
decode. The computation is diffusers' WanPipeline (text-to-video, text-to-image as one frame) and
WanImageToVideoPipeline with expand_timesteps (how diffusers runs TI2V-5B image-to-video), 0.36,
request by request:

    encode (one-shot)   the prompt and, with guidance, the negative prompt (default "") through
                        UMT5: [512, d_model] states each, cut to the prompt's tokens and zero-padded
                        (text_encoder.py); the distinct texts of a batch in one encoder call
    denoise (loop)      latents [1, z, 1 + (F - 1) // 4, H / 16, W / 16] float32, drawn as diffusers'
                        prepare_latents draws them: torch.randn of that shape from a CPU
                        torch.Generator seeded with the request's seed, then moved to the device
                        (diffusers' randn_tensor with generator=torch.Generator().manual_seed(seed));
                        the scheduler (FlowUniPCScheduler: UniPC with flow sigmas, flow_shift) has one
                        state per request; each step is one transformer forward over the batch's
                        rows, the cond rows then (guidance_scale > 1) the uncond rows, guided per
                        request in the transformer's dtype: uncond + g * (cond - uncond), then the
                        scheduler step on the float32 latents. On CUDA the forward replays a
                        CUDA graph per batch shape (MSTAR_DIT_GRAPHS; text-to-video and images)
    image-to-video      (expand_timesteps) the image, resized to W x H (PIL Lanczos, as diffusers'
                        VideoProcessor; none when it has that size) and scaled to [-1, 1], is one
                        frame through the VAE encoder (the posterior mean), normalised
                        ((z - mean) / std); every step the transformer sees the first latent frame
                        replaced by it, at timestep 0 (per-token timesteps: t elsewhere), and the
                        final latents get it too
    decode (one-shot)   denormalised latents (z * std + mean, in the VAE's dtype) through the VAE
                        decoder; pixels (v / 2 + 0.5).clamp(0, 1), as float32, * 255 rounded to uint8
                        (diffusers' np output, and its numpy_to_pil rounding)

Frames: num_frames not of the form 4k + 1 is rounded as diffusers does (n // 4 * 4 + 1), so the
video may have a few frames more or fewer than asked (8 -> 9, 3 -> 1).

A request's inputs (MediaRequest.inputs, what the image / video routes pass):

    prompt (required), negative_prompt, width + height (one of `sizes`, as "WxH"), num_frames
    (absent: an image -> interfaces.Image; given: a video -> interfaces.VideoFrames, even of one
    frame), fps (of the VideoFrames; default the model's), num_inference_steps, guidance_scale,
    flow_shift (default: the scheduler config's), image (uint8 [h, w, 3] RGB: image-to-video)

Batching: the denoise loop batches requests of one (height, width, frames, steps, guidance > 1,
image or not); their prompts, seeds, guidance scales and flow shifts may differ (a scheduler state
and a guidance scale per request). The loop is continuous (join / leave): a request of a running
batch's key joins it before its next step, whatever step the others are at, and leaves it after
its own last step. Decode batches one (height, width, frames). A request the
pipeline cannot take fails in the first stage's batch_key, alone, with "field: message".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mstar.models import interfaces as I
from mstar.models.generation_request import FieldLimits, field_error, initial_noise, media_outputs, read_fields
from mstar.models.host_copy import to_device
from mstar.models.shape_graphs import denoiser_step

MAX_INPUT_CHARS = 4000
MAX_STEPS = 200


@dataclass
class Params:
    """A request's validated generation parameters."""
    prompt: str
    negative_prompt: str
    width: int
    height: int
    frames: int  # after diffusers' 4k + 1 rounding
    video: bool  # VideoFrames out (num_frames given), else an Image
    fps: float
    steps: int
    guidance: float
    flow_shift: float | None
    image: np.ndarray | None

    @property
    def cfg(self) -> bool:
        return self.guidance > 1.0


def round_frames(n: int, temporal: int = 4) -> int:
    """diffusers' rule: num_frames - 1 must divide by the VAE's temporal factor, else n // 4 * 4 + 1."""
    if n % temporal != 1:
        n = n // temporal * temporal + 1
    return max(n, 1)


def image_tensor(image: np.ndarray, width: int, height: int) -> torch.Tensor:
    """uint8 [h, w, 3] -> float32 [3, height, width] in [-1, 1], as diffusers' VideoProcessor.preprocess
    does a PIL image (Lanczos resize when the size differs; x / 255 in float32, then 2x - 1)."""
    px = np.ascontiguousarray(image, dtype=np.uint8)
    if px.shape[0] != height or px.shape[1] != width:
        try:
            from PIL import Image as PILImage
        except ImportError:  # no PIL: torch's antialiased bicubic (close, not diffusers' numbers)
            t = torch.from_numpy(px).permute(2, 0, 1)[None].float()
            t = torch.nn.functional.interpolate(t, size=(height, width), mode="bicubic", antialias=True)
            px = t.round().clamp(0, 255).to(torch.uint8)[0].permute(1, 2, 0).numpy()
        else:
            px = np.asarray(PILImage.fromarray(px, "RGB").resize((width, height), resample=PILImage.LANCZOS))
    x = torch.from_numpy(px.astype(np.float32) / 255.0).permute(2, 0, 1)
    return 2.0 * x - 1.0


class WanPipeline(I.Pipeline):
    """The stages (module docstring) over loaded components: transformer (WanTransformer), vae
    (WanVAE), text_encoder (WanTextEncoder), scheduler (FlowUniPCScheduler)."""

    def __init__(self, transformer, vae, text_encoder, scheduler, *, expand_timesteps: bool = True,
                 sizes=("1280x704",), max_frames: int = 121, fps: float = 24.0, num_inference_steps: int = 50,
                 guidance_scale: float = 5.0, max_batch: int = 8, max_input_chars: int = MAX_INPUT_CHARS,
                 max_steps: int = MAX_STEPS):
        self.transformer, self.vae, self.text_encoder, self.scheduler = transformer, vae, text_encoder, scheduler
        # the text's keys / values (computed once a batch: transformer.text_kv) change only on join / leave
        self.graphed_transformer = denoiser_step(transformer.forward_kv, constant_from=2)
        self.expand_timesteps = bool(expand_timesteps)
        self.sizes = tuple(str(s) for s in sizes)
        self.max_frames = int(max_frames)
        self.fps = float(fps)
        self.num_inference_steps = int(num_inference_steps)
        self.guidance_scale = float(guidance_scale)
        self.max_input_chars = int(max_input_chars)
        self.max_steps = int(max_steps)
        # every mode's default size is the first; shift None: the scheduler config's
        self.limits = FieldLimits(self.sizes, self.max_frames, self.fps, self.max_steps, self.max_input_chars,
                                  lambda video: (self.sizes[0], self.num_inference_steps, self.guidance_scale))
        vcfg = vae.config
        self.spatial, self.temporal = int(vcfg.scale_factor_spatial), int(vcfg.scale_factor_temporal)
        if transformer.config.in_channels != vcfg.z_dim:
            raise ValueError(f"wan: the transformer takes {transformer.config.in_channels} latent channels, the VAE "
                             f"makes {vcfg.z_dim}")
        if text_encoder.dim != transformer.config.text_dim:
            raise ValueError(f"wan: the transformer takes text states of width {transformer.config.text_dim}, the "
                             f"text encoder makes {text_encoder.dim}")
        step = self.spatial * int(transformer.config.patch_size[1])
        for s in self.sizes:
            w, h = (int(v) for v in s.split("x"))
            if w % step or h % step:
                raise ValueError(f"wan: size {s} is not a multiple of {step} (VAE x patch)")
        mb = max(1, int(max_batch or 8))
        super().__init__(
            stages=[I.OneShotStage(self.encode, batch_key=self.check, max_batch=min(mb, 16)),
                    I.FixedStepLoopStage(self.start, self.step, self.finish, self.num_steps,
                                         batch_key=self.denoise_key, max_batch=min(mb, 8), join=self.join,
                                         leave=self.leave),
                    I.OneShotStage(self.decode, batch_key=self.decode_key, max_batch=min(mb, 4))],
            accepts={"sizes": list(self.sizes), "max_frames": self.max_frames, "fps": self.fps,
                     "max_input_chars": self.max_input_chars, "max_steps": self.max_steps,
                     "image_input": self.expand_timesteps})

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    # -- requests ---------------------------------------------------------------------------------
    def params(self, inputs: dict[str, Any]) -> Params:
        """The request's parameters; ValueError("field: message") for what it cannot take."""
        f = read_fields(inputs, self.limits)
        image = inputs.get("image")
        if image is not None:
            if not self.expand_timesteps:
                raise field_error("image", "this model does not take an input image (its model_index.json has no "
                                           "expand_timesteps: only the Wan2.2 TI2V kind conditions on the first "
                                           "frame)")
            if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 \
                    or image.shape[2] != 3 or min(image.shape[:2]) < 1:
                raise field_error("image", "must be a uint8 RGB array [height, width, 3]")
        return Params(f.prompt, f.negative_prompt, f.width, f.height, round_frames(f.num_frames, self.temporal),
                      f.video, f.fps, f.steps, f.guidance, f.flow_shift, image)

    def check(self, req: I.MediaRequest):
        """The first stage's key: every request is encoded with the others; refuses bad inputs."""
        self.params(req.inputs)
        return None

    def denoise_key(self, req: I.MediaRequest):
        p = self.params(req.inputs)
        return (p.height, p.width, p.frames, p.steps, p.cfg, p.image is not None)

    def decode_key(self, req: I.MediaRequest):
        p = self.params(req.inputs)
        return (p.height, p.width, p.frames)

    def latent_shape(self, p: Params) -> tuple[int, int, int, int, int]:
        return (1, int(self.transformer.config.in_channels), (p.frames - 1) // self.temporal + 1,
                p.height // self.spatial, p.width // self.spatial)

    def noise(self, p: Params, seed: int) -> torch.Tensor:
        return initial_noise(self.latent_shape(p), seed, self.device)

    # -- stage 0: text ------------------------------------------------------------------------------
    def encode(self, reqs: list[I.MediaRequest]) -> list[list]:
        ps = [self.params(r.inputs) for r in reqs]
        texts = list(dict.fromkeys([p.prompt for p in ps] + [p.negative_prompt for p in ps if p.cfg]))
        states = self.text_encoder.encode(texts, dtype=self.transformer.dtype)
        row = {t: i for i, t in enumerate(texts)}
        rows = [states[i].clone() for i in range(len(texts))]  # each request holds its own rows only
        return [[rows[row[p.prompt]], rows[row[p.negative_prompt]] if p.cfg else None] for p in ps]

    # -- stage 1: denoise ---------------------------------------------------------------------------
    def start(self, reqs: list[I.MediaRequest]) -> dict:
        """The loop state of a batch: per request its noise, scheduler state, text rows, guidance
        scale and (image-to-video) conditioning latents, as rows in request order."""
        ps = [self.params(r.inputs) for r in reqs]
        p0, dev, dt = ps[0], self.device, self.transformer.dtype
        latents = torch.cat([self.noise(p, r.seed) for p, r in zip(ps, reqs)])
        scheds = [self.scheduler.new_state(p.steps, flow_shift=p.flow_shift) for p in ps]  # timesteps on the CPU
        text = [r.inputs["previous"][0] for r in reqs]
        if p0.cfg:
            text += [r.inputs["previous"][1] for r in reqs]
        state = {"latents": latents, "scheds": scheds, "text": torch.stack(text).to(device=dev, dtype=dt),
                 "guidance": [p.guidance for p in ps], "cfg": p0.cfg, "cond": None, "mask": None}
        if p0.image is not None:
            px = torch.stack([image_tensor(p.image, p.width, p.height) for p in ps])[:, :, None]
            z = self.vae.encode(px.to(device=dev, dtype=self.vae.dtype)).float()
            state["cond"] = self.vae.normalize_latents(z)
            mask = torch.ones(1, 1, *latents.shape[2:], dtype=torch.float32, device=dev)
            mask[:, :, 0] = 0
            state["mask"] = mask
        return state

    @staticmethod
    def _text_halves(state: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The state's text rows as (cond [B, L, d], uncond [B, L, d] or None)."""
        text, B = state["text"], state["latents"].shape[0]
        return (text[:B], text[B:]) if state["cfg"] else (text, None)

    def join(self, state: dict, reqs: list[I.MediaRequest]) -> dict:
        """Requests of the batch's key appended as its last rows (each with its own scheduler
        state at step 0: the loop is continuous, every request runs its own steps)."""
        new = self.start(reqs)
        (c0, u0), (c1, u1) = self._text_halves(state), self._text_halves(new)
        text = [c0, c1] + ([u0, u1] if state["cfg"] else [])
        out = {"latents": torch.cat([state["latents"], new["latents"]]), "scheds": state["scheds"] + new["scheds"],
               "text": torch.cat(text), "guidance": state["guidance"] + new["guidance"], "cfg": state["cfg"],
               "cond": None, "mask": state["mask"]}
        if state["cond"] is not None:
            out["cond"] = torch.cat([state["cond"], new["cond"]])
        return out

    def leave(self, state: dict, rows: list[int]) -> tuple[dict, list[list]]:
        """The rows' final latents out (as finish gives them), the others kept in the state."""
        done = self._composite(state)
        outputs = [[done[j:j + 1]] for j in rows]
        gone = set(rows)
        keep = [j for j in range(len(state["scheds"])) if j not in gone]
        idx = to_device(torch.tensor(keep, dtype=torch.long), state["latents"].device)
        cond, uncond = self._text_halves(state)
        text = [cond.index_select(0, idx)] + ([uncond.index_select(0, idx)] if state["cfg"] else [])
        out = {"latents": state["latents"].index_select(0, idx), "scheds": [state["scheds"][j] for j in keep],
               "text": torch.cat(text), "guidance": [state["guidance"][j] for j in keep], "cfg": state["cfg"],
               "cond": None if state["cond"] is None else state["cond"].index_select(0, idx),
               "mask": state["mask"]}
        return out, outputs

    def _text_kv(self, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's text keys / values (transformer.text_kv of state["text"]), made on the first
        step after the batch's rows changed (start, join and leave make a new state)."""
        if state.get("text_kv") is None:
            state["text_kv"] = self.transformer.text_kv(state["text"])
        return state["text_kv"]

    def num_steps(self, state: dict) -> int:
        return len(state["scheds"][0].timesteps)

    @staticmethod
    def _composite(state: dict) -> torch.Tensor:
        """The latents with the conditioning first frame in place (image-to-video), else as they are."""
        x, cond, mask = state["latents"], state["cond"], state["mask"]
        return x if cond is None else (1 - mask) * cond + mask * x

    def step(self, state: dict, i: int) -> None:
        x = state["latents"]
        B, dt = x.shape[0], self.transformer.dtype
        if state["mask"] is not None:  # per-token timesteps: 0 on the conditioning frame
            pt, ph, pw = self.transformer.patch_size
            base = state["mask"][0, 0][::pt, ::ph, ::pw].flatten()
            t = torch.stack([base * float(s.timestep) for s in state["scheds"]])
        else:
            t = self.scheduler.current_timesteps(state["scheds"], torch.float32, x.device)
        inp = self._composite(state).to(dt)
        if state["cfg"]:
            inp, t = torch.cat([inp, inp]), torch.cat([t, t])
        # per-token timesteps take a host sync inside the forward (torch.unique): no graph
        forward = self.transformer.forward_kv if state["mask"] is not None else self.graphed_transformer
        out = forward(inp, t, *self._text_kv(state))
        new = []
        for k, (sched, g) in enumerate(zip(state["scheds"], state["guidance"])):
            pred = out[k:k + 1]
            if state["cfg"]:
                uncond = out[B + k:B + k + 1]
                pred = uncond + g * (pred - uncond)
            new.append(self.scheduler.step(sched, pred, x[k:k + 1]))
        state["latents"] = torch.cat(new)

    def finish(self, state: dict) -> list[list]:
        return [[z] for z in self._composite(state).split(1)]

    # -- stage 2: decode ----------------------------------------------------------------------------
    def decode(self, reqs: list[I.MediaRequest]) -> list[list]:
        ps = [self.params(r.inputs) for r in reqs]
        z = torch.cat([r.inputs["previous"][0] for r in reqs]).to(self.vae.dtype)
        return media_outputs(self.vae.decode(self.vae.denormalize_latents(z)), ps)


__all__ = ["MAX_INPUT_CHARS", "Params", "round_frames", "image_tensor", "WanPipeline"]
