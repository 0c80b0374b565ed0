"""Cosmos3 presets: the published Cosmos3-Edge shapes (nvidia/Cosmos3-Edge) with random weights, and
a tiny embedded model for tests. A preset's config is the whole pipeline, as the diffusers
directory spells it:

    transformer      transformer/config.json (Cosmos3OmniTransformer, the Edge / relu2 backbone)
    vae              vae/config.json (AutoencoderKLWan: the release packages Wan2.2-TI2V-5B's VAE)
    scheduler        scheduler/scheduler_config.json (UniPCMultistepScheduler, flow sigmas, flow_shift 5)
    flow_sigmas      the sigma schedule: "native" (model_index.json's use_native_flow_schedule, the
                     Edge release) or "diffusers-0.40" (the flag absent)
    use_system_prompt  model_index.json's default_use_system_prompt (Edge: false)
    sizes, max_frames, fps, and per mode (image / video) the default size, steps and guidance;
    flow_shift       what the routes may ask and the defaults (below)

Defaults. The release's recommended settings (the Edge model card's commands, which NVIDIA's
serving integrations adopt) are used, not the diffusers pipeline's call defaults (1280x720, 189
frames, 35 steps, guidance 6, the scheduler config's flow_shift 5, which are Cosmos3-Nano's):
    image   640x640, 50 steps, guidance 4.0, flow_shift 3.0
    video   832x480 at 24 fps, 50 steps, guidance 5.0, flow_shift 3.0
Sizes: Edge is trained at 480p and 256p; the routes take the 480p bins (832x480, 640x640,
480x832, 736x544, 544x736) and the 256p ones (320x192, 256x256, 192x320, 320x256, 256x320);
the first (832x480) is the routes' default size. At most 300 frames (the Cosmos3 family's limit).

    name            transformer (hidden / layers / ffn, heads q / kv)   VAE z   parameters
    cosmos3-edge    2048 / 28 / 9216, 16 / 8, head_dim 128              48      3.10 B built + VAE
    tiny-cosmos3    32 / 2 / 64, 4 / 2, head_dim 16                     8       ~0.1 M

"built": both towers, the embedding and the vision heads; the release's transformer has 3.37 B
with its lm_head (0.27 B) and action heads, which text-to-image / text-to-video do not run.
The presets' tokenizer is the offline byte tokenizer (prompt.byte_tokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mstar.models.config_fields import field_values, split_fields
from mstar.models.cosmos3.config import COSMOS3_EDGE_TRANSFORMER, TINY_COSMOS3_TRANSFORMER
from mstar.models.presets import Preset
from mstar.models.wan.scheduler_config import FLOW_SIGMAS_NATIVE, WAN22_TI2V_5B_SCHEDULER
from mstar.models.wan.vae_config import TINY_WAN22_TI2V_VAE, WAN22_TI2V_5B_VAE

MODEL_TYPE = "cosmos3"

# the release's scheduler/scheduler_config.json: diffusers' Cosmos3 conversion writes UniPC with flow
# sigmas, bh2, order 2, predict_x0, lower_order_final, final sigma zero, flow_shift 5.0 (Wan2.2's)
COSMOS3_EDGE_SCHEDULER: dict[str, Any] = dict(WAN22_TI2V_5B_SCHEDULER)

PUBLISHED_SIZES = ("832x480", "640x640", "480x832", "736x544", "544x736",
                   "320x192", "256x256", "192x320", "320x256", "256x320")
TINY_SIZES = ("64x64", "96x64", "64x96", "32x32")  # multiples of 32: VAE 16 x patch 2


@dataclass
class Cosmos3Config:
    """A Cosmos3 pipeline's configuration (a preset's, or read from a diffusers directory)."""
    transformer: dict[str, Any]
    vae: dict[str, Any]
    scheduler: dict[str, Any]
    flow_sigmas: str = FLOW_SIGMAS_NATIVE
    use_system_prompt: bool = False
    sizes: tuple[str, ...] = PUBLISHED_SIZES
    max_frames: int = 300
    fps: float = 24.0
    flow_shift: float = 3.0
    image_size: str = "640x640"
    image_steps: int = 50
    image_guidance: float = 4.0
    video_size: str = "832x480"
    video_steps: int = 50
    video_guidance: float = 5.0
    model_type: str = MODEL_TYPE
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: dict) -> "Cosmos3Config":
        kw, raw = split_fields(cls, raw)
        if "sizes" in kw:
            kw["sizes"] = tuple(kw["sizes"])
        return cls(extra=raw, **kw)

    def to_dict(self) -> dict[str, Any]:
        out = field_values(self)
        out["sizes"] = list(self.sizes)
        return out

    def defaults(self) -> dict[str, Any]:
        """The pipeline's per-mode defaults (Cosmos3Pipeline's keyword arguments)."""
        return {"sizes": self.sizes, "max_frames": self.max_frames, "fps": self.fps, "flow_shift": self.flow_shift,
                "image_defaults": (self.image_size, self.image_steps, self.image_guidance),
                "video_defaults": (self.video_size, self.video_steps, self.video_guidance)}


# what a directory of the tiny shape gets in place of the published sizes
TINY_SETTINGS: dict[str, Any] = {"sizes": list(TINY_SIZES), "image_size": "64x64", "video_size": "96x64",
                                 "max_frames": 17}

COSMOS3_EDGE: dict[str, Any] = {
    "transformer": COSMOS3_EDGE_TRANSFORMER, "vae": WAN22_TI2V_5B_VAE, "scheduler": COSMOS3_EDGE_SCHEDULER,
    "flow_sigmas": FLOW_SIGMAS_NATIVE, "use_system_prompt": False, "sizes": list(PUBLISHED_SIZES),
}

TINY_COSMOS3: dict[str, Any] = {
    "transformer": TINY_COSMOS3_TRANSFORMER, "vae": TINY_WAN22_TI2V_VAE, "scheduler": COSMOS3_EDGE_SCHEDULER,
    "flow_sigmas": FLOW_SIGMAS_NATIVE, "use_system_prompt": False, **TINY_SETTINGS,
    "image_steps": 4, "video_steps": 4,
}

PRESETS: tuple[Preset, ...] = (
    Preset("cosmos3-edge", MODEL_TYPE, COSMOS3_EDGE,
           note="Cosmos3-Edge generator (text to image / video, 480p, Wan2.2 VAE), random weights"),
    Preset("tiny-cosmos3", MODEL_TYPE, TINY_COSMOS3, embedded=True,
           note="tiny random Cosmos3 (test model: text -> image / video, byte tokenizer)"),
)


def get(name: str) -> Preset | None:
    return {p.name: p for p in PRESETS}.get(name.lower())


__all__ = ["MODEL_TYPE", "COSMOS3_EDGE_SCHEDULER", "PUBLISHED_SIZES", "TINY_SIZES", "Cosmos3Config", "TINY_SETTINGS",
           "COSMOS3_EDGE", "TINY_COSMOS3", "PRESETS", "get"]
