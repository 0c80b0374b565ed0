"""Cosmos3 text-to-image and text-to-video as three stages of the stage engine: understand ->
denoise loop -> VAE decode. The computation is diffusers' Cosmos3OmniPipeline (0.42) request by
request, without its per-step re-run of the understanding tower:

    understand (one-shot)  the prompt and, with guidance (guidance_scale != 1), the negative
                           prompt ("" by default) made into token ids (prompt.py), then each
                           distinct id sequence of the batch through the understanding tower in
                           one call: per prompt its keys / values of every layer (an
                           UnderstandingKV), computed once per request and guidance branch
    denoise (loop)         latents [1, z, 1 + (F - 1) // 4, H / 16, W / 16] float32, drawn as diffusers
                           draws them: torch.randn of that shape from a CPU torch.Generator seeded
                           with the request's seed, then moved to the device; a scheduler state per
                           request (FlowUniPCScheduler with the checkpoint's sigma schedule and the
                           request's flow_shift); each step is one generation-tower forward over the
                           batch's rows (the cond rows, then with guidance the uncond rows: the same
                           latents after another prompt, at other positions), each reading its own
                           prompt's cached K/V, laid out once per batch (JointKV) with room for the
                           vision keys each step writes (on CUDA a graph per batch shape:
                           MSTAR_DIT_GRAPHS); guided per request in float32
                           (uncond + g * (cond - uncond), diffusers' order), then the scheduler step
    decode (one-shot)      denormalised latents (z * std + mean, in the VAE's dtype) through the Wan2.2
                           VAE decoder; pixels (v / 2 + 0.5).clamp(0, 1), float32, * 255 rounded to
                           uint8 (diffusers' np output and its numpy_to_pil rounding)

Frames: as diffusers, num_frames is taken as given (it is in the prompt's duration sentence and
the rotary's fps scaling); the VAE makes 1 + 4 * ((num_frames - 1) // 4) of them (8 -> 5).

A request's inputs (MediaRequest.inputs, what the image / video routes pass):

    prompt (required), negative_prompt, width + height (one of `sizes`, as "WxH"), num_frames
    (absent: an image -> interfaces.Image; given: a video -> interfaces.VideoFrames, even of one
    frame), fps (default the model's), num_inference_steps, guidance_scale, flow_shift. An image
    (image-to-video) is refused. The defaults depend on the mode (image: no num_frames).

Batching: the denoise loop batches requests of one (height, width, latent frames, steps, guidance
or not); their prompts, seeds, fps, guidance scales and flow shifts may differ. The loop is
continuous (join / leave at step granularity, as Wan's). Decode batches one (height, width,
latent frames). A request the pipeline cannot take fails in the first stage's batch_key, alone,
with "field: message".
"""

from __future__ import annotations

from typing import Any

import torch

from mstar.models import interfaces as I
from mstar.models.cosmos3 import rope
from mstar.models.cosmos3.transformer import JointKV
from mstar.models.generation_request import (FieldLimits, GenerationFields, field_error, initial_noise, media_outputs,
                                             parse_size, read_fields)
from mstar.models.host_copy import to_device
from mstar.models.shape_graphs import denoiser_step

MAX_INPUT_CHARS = 4000
MAX_STEPS = 200


class Params(GenerationFields):
    """A request's validated generation parameters (num_frames as asked: the VAE makes
    1 + 4 * ((num_frames - 1) // 4))."""

    @property
    def cfg(self) -> bool:
        return self.guidance != 1.0  # diffusers' test: guidance 0.5 still runs the uncond branch


class Cosmos3Pipeline(I.Pipeline):
    """The stages (module docstring) over loaded components: transformer (Cosmos3Transformer), vae
    (WanVAE), prompter (prompt.Cosmos3Prompter), scheduler (FlowUniPCScheduler).
    image_defaults / video_defaults: (size "WxH", steps, guidance) of each mode."""

    def __init__(self, transformer, vae, prompter, scheduler, *, sizes=("832x480",), max_frames: int = 300,
                 fps: float = 24.0, flow_shift: float = 3.0, image_defaults=("640x640", 50, 4.0),
                 video_defaults=("832x480", 50, 5.0), max_batch: int = 8, max_input_chars: int = MAX_INPUT_CHARS,
                 max_steps: int = MAX_STEPS):
        self.transformer, self.vae, self.prompter, self.scheduler = transformer, vae, prompter, scheduler
        # compiled / graphed per batch shape, as Wan's; the rows, tables and prompt K/V change only on join / leave
        self.graphed = denoiser_step(transformer.generate_rows, constant_from=2)
        self.sizes = tuple(str(s) for s in sizes)
        self.max_frames, self.fps, self.flow_shift = int(max_frames), float(fps), float(flow_shift)
        self.defaults = {False: tuple(image_defaults), True: tuple(video_defaults)}  # by `video`
        self.max_input_chars, self.max_steps = int(max_input_chars), int(max_steps)
        self.limits = FieldLimits(self.sizes, self.max_frames, self.fps, self.max_steps, self.max_input_chars,
                                  self.defaults.__getitem__, self.flow_shift)
        vcfg = vae.config
        self.spatial, self.temporal = int(vcfg.scale_factor_spatial), int(vcfg.scale_factor_temporal)
        transformer.config.check_vae(int(vcfg.z_dim), self.temporal)
        step = self.spatial * int(transformer.config.latent_patch_size)
        for s in self.sizes + tuple(d[0] for d in self.defaults.values()):
            w, h = parse_size(s)
            if w % step or h % step:
                raise ValueError(f"cosmos3: size {s} is not a multiple of {step} (VAE x patch)")
        mb = max(1, int(max_batch or 8))
        super().__init__(
            stages=[I.OneShotStage(self.understand, batch_key=self.check, max_batch=min(mb, 16)),
                    I.FixedStepLoopStage(self.start, self.step, self.finish, self.num_steps,
                                         batch_key=self.denoise_key, max_batch=min(mb, 8), join=self.join,
                                         leave=self.leave),
                    I.OneShotStage(self.decode, batch_key=self.decode_key, max_batch=min(mb, 4))],
            accepts={"sizes": list(self.sizes), "max_frames": self.max_frames, "fps": self.fps,
                     "max_input_chars": self.max_input_chars, "max_steps": self.max_steps, "image_input": False})

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    # -- requests ---------------------------------------------------------------------------------
    def params(self, inputs: dict[str, Any]) -> Params:
        """The request's parameters; ValueError("field: message") for what it cannot take."""
        if inputs.get("image") is not None:
            raise field_error("image", "this model does not take an input image (text to image and text to video "
                                       "only)")
        return read_fields(inputs, self.limits, Params)

    def latent_frames(self, p: Params) -> int:
        return 1 + (p.num_frames - 1) // self.temporal

    def check(self, req: I.MediaRequest):
        """The first stage's key: every request is understood with the others; refuses bad inputs."""
        self.params(req.inputs)
        return None

    def denoise_key(self, req: I.MediaRequest):
        p = self.params(req.inputs)
        return (p.height, p.width, self.latent_frames(p), p.steps, p.cfg)

    def decode_key(self, req: I.MediaRequest):
        p = self.params(req.inputs)
        return (p.height, p.width, self.latent_frames(p))

    def latent_shape(self, p: Params) -> tuple[int, int, int, int, int]:
        return (1, int(self.transformer.config.latent_channel), self.latent_frames(p), p.height // self.spatial,
                p.width // self.spatial)

    def noise(self, p: Params, seed: int) -> torch.Tensor:
        return initial_noise(self.latent_shape(p), seed, self.device)

    def prompt_ids(self, p: Params) -> list[list[int]]:
        """[cond ids] or, with guidance, [cond ids, uncond ids]."""
        cond, uncond = self.prompter.prompt_ids(p.prompt, p.negative_prompt, num_frames=p.num_frames,
                                                height=p.height, width=p.width, fps=p.fps)
        return [cond, uncond] if p.cfg else [cond]

    # -- stage 0: the understanding tower ---------------------------------------------------------
    def understand(self, reqs: list[I.MediaRequest]) -> list[list]:
        per_req = [self.prompt_ids(self.params(r.inputs)) for r in reqs]
        distinct = list(dict.fromkeys(tuple(ids) for ids in sum(per_req, [])))
        cfg = self.transformer.config
        tables = [rope.rope_table(rope.text_positions(len(ids), cfg), cfg) for ids in distinct]
        kvs = dict(zip(distinct, self.transformer.understand([list(ids) for ids in distinct], tables)))
        return [[kvs[tuple(ids)] for ids in branches] for branches in per_req]

    # -- stage 1: denoise ---------------------------------------------------------------------------
    def _vision_table(self, p: Params, prompt_len: int) -> torch.Tensor:
        cfg = self.transformer.config
        _, _, t, h, w = self.latent_shape(p)
        pp = cfg.latent_patch_size
        pos = rope.vision_positions((t, h // pp, w // pp), rope.vision_offset(prompt_len, cfg), p.fps,
                                    self.temporal, cfg)
        return to_device(rope.rope_table(pos, cfg), self.device)

    def start(self, reqs: list[I.MediaRequest]) -> dict:
        """The loop state of a batch: per request its latents row, scheduler state, guidance scale,
        and per guidance branch its prompt's K/V and vision rotary table."""
        ps = [self.params(r.inputs) for r in reqs]
        items = []
        for p, r in zip(ps, reqs):
            und = list(r.inputs["previous"])
            items.append({"und": und, "tables": [self._vision_table(p, u.length) for u in und]})
        state = {"latents": torch.cat([self.noise(p, r.seed) for p, r in zip(ps, reqs)]),
                 "scheds": [self.scheduler.new_state(p.steps, flow_shift=p.flow_shift) for p in ps],
                 "guidance": [p.guidance for p in ps], "cfg": ps[0].cfg, "items": items}
        return self._assemble(state)

    def _assemble(self, state: dict) -> dict:
        """The rows of the batch's forward: every request's cond branch, then its uncond branch,
        with their prompts' K/V laid out once for every step (JointKV)."""
        items, branches = state["items"], (2 if state["cfg"] else 1)
        order = [(j, b) for b in range(branches) for j in range(len(items))]
        state["rows"] = [j for j, _ in order]
        state["und"] = [items[j]["und"][b] for j, b in order]
        state["table"] = torch.cat([items[j]["tables"][b] for j, b in order])
        state["idx"] = to_device(torch.tensor(state["rows"], dtype=torch.long), state["latents"].device)
        T, h, w = self.transformer.grid(state["latents"])
        state["joint"] = JointKV.of(state["und"], T * h * w)
        return state

    def join(self, state: dict, reqs: list[I.MediaRequest]) -> dict:
        """Requests of the batch's key appended as its last rows (each at its own step 0)."""
        new = self.start(reqs)
        out = {"latents": torch.cat([state["latents"], new["latents"]]), "scheds": state["scheds"] + new["scheds"],
               "guidance": state["guidance"] + new["guidance"], "cfg": state["cfg"],
               "items": state["items"] + new["items"]}
        return self._assemble(out)

    def leave(self, state: dict, rows: list[int]) -> tuple[dict, list[list]]:
        """The rows' final latents out, the others kept in the state."""
        outputs = [[state["latents"][j:j + 1]] for j in rows]
        keep = [j for j in range(len(state["scheds"])) if j not in set(rows)]
        idx = to_device(torch.tensor(keep, dtype=torch.long), state["latents"].device)
        out = {"latents": state["latents"].index_select(0, idx), "scheds": [state["scheds"][j] for j in keep],
               "guidance": [state["guidance"][j] for j in keep], "cfg": state["cfg"],
               "items": [state["items"][j] for j in keep]}
        return self._assemble(out), outputs

    def num_steps(self, state: dict) -> int:
        return len(state["scheds"][0].timesteps)

    def step(self, state: dict, i: int) -> None:
        x = state["latents"]
        B = x.shape[0]
        t = self.scheduler.current_timesteps(state["scheds"], torch.long, x.device)
        j = state["joint"]
        out = self.graphed(x, t, state["idx"], state["table"], j.kv_rows, j.k, j.v, j.prompt_lens)
        new = []
        for k, (sched, g) in enumerate(zip(state["scheds"], state["guidance"])):
            v = out[k:k + 1].float()
            if state["cfg"]:
                uncond = out[B + k:B + k + 1].float()
                v = uncond + g * (v - uncond)
            new.append(self.scheduler.step(sched, v, x[k:k + 1]))
        state["latents"] = torch.cat(new)

    def finish(self, state: dict) -> list[list]:
        return [[z] for z in state["latents"].split(1)]

    # -- stage 2: decode ----------------------------------------------------------------------------
    def decode(self, reqs: list[I.MediaRequest]) -> list[list]:
        ps = [self.params(r.inputs) for r in reqs]
        z = torch.cat([r.inputs["previous"][0] for r in reqs]).to(self.vae.dtype)
        return media_outputs(self.vae.decode(self.vae.denormalize_latents(z)), ps)


__all__ = ["MAX_INPUT_CHARS", "MAX_STEPS", "Params", "Cosmos3Pipeline"]
