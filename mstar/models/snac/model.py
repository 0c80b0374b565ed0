"""SNAC's decoder: codes of a multi-scale residual VQ -> audio (hubertsiuzdak/snac, "Multi-Scale
Neural Audio Codec"). Only the decode direction: the encoder's weights in a checkpoint are not
read.

Codes: one LongTensor [B, T_i] per codebook; codebook i runs at 1 / vq_strides[i] of the latent
rate, so T_i * vq_strides[i] is the same for every i (the 24 kHz model: strides [4, 2, 1], codes
[B, T], [B, 2T], [B, 4T], latent length 4T). Each codebook's vectors go through its 1x1 output
projection, are repeated `stride` times along time and summed into the latent [B, latent_dim, 4T].

The decoder then upsamples the latent by prod(decoder_rates) (= the hop, 512 at 24 kHz) to
[B, 1, 4T * 512] samples in [-1, 1]:

    depthwise k7 conv + 1x1 conv to decoder_dim (or one k7 conv when not depthwise)
    per rate r (channels halve each block):
        snake, transposed conv (kernel 2r, stride r), noise, residual units of dilation 1, 3, 9
    snake, k7 conv to one channel, tanh

A residual unit is x + conv1x1(snake(conv_k7_dilated(snake(x)))), its k7 conv depthwise when the
config says so. Convolutions are weight-normed in the release; the loader folds each into a plain
weight (weight = g * v / ||v||, the norm over every dim but 0, as torch's weight_norm(dim=0)), so
a forward is plain conv calls.

Noise: the release's decoder blocks add x + conv1x1(x) * n, n ~ N(0, 1) of shape [B, 1, T], drawn
anew at every decode. noise=True does the same, n from `generator`: torch's global generator
(None), a torch.Generator, a list of one per row, or an int64 tensor of one seed per row, for
counter-based noise (mstar.ops.sampling.normal_noise, noise block i drawing stream i): what the
served path uses, since it is the same for a row in any batch and a CUDA graph can replay it.
noise=False drops the term (n = 0) for deterministic output.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from mstar import ops
from mstar.ops.sampling import normal_noise

# where the noise blocks' n comes from (the module docstring): None, a generator, one per row, seeds
NoiseSource = torch.Generator | list | tuple | torch.Tensor | None


@dataclass
class SNACConfig:
    """The keys of a SNAC checkpoint's config.json (the release's SNAC constructor arguments)."""
    sampling_rate: int = 24000
    encoder_dim: int = 48
    encoder_rates: list[int] = field(default_factory=lambda: [2, 4, 8, 8])
    latent_dim: int | None = None  # None: encoder_dim * 2 ** len(encoder_rates)
    decoder_dim: int = 1024
    decoder_rates: list[int] = field(default_factory=lambda: [8, 8, 4, 2])
    attn_window_size: int | None = None
    codebook_size: int = 4096
    codebook_dim: int = 8
    vq_strides: list[int] = field(default_factory=lambda: [4, 2, 1])
    noise: bool = True
    depthwise: bool = True

    @classmethod
    def from_dict(cls, raw: dict) -> "SNACConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"SNAC config: unknown keys {unknown}")
        return cls(**raw)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def latent(self) -> int:
        return self.latent_dim if self.latent_dim is not None else self.encoder_dim * 2 ** len(self.encoder_rates)

    @property
    def hop_length(self) -> int:
        return math.prod(self.encoder_rates)

    @property
    def samples_per_frame(self) -> int:
        """Samples of one code of the coarsest codebook (2048 at 24 kHz)."""
        return self.hop_length * max(self.vq_strides)


# --- layers (parameter names follow the release's state dict, weight norm folded) -------------
class _Conv(nn.Module):
    """A 1-d convolution (or transposed convolution) with a plain weight."""

    def __init__(self, c_in: int, c_out: int, kernel: int, *, stride: int = 1, padding: int = 0,
                 dilation: int = 1, groups: int = 1, bias: bool = True, transposed: bool = False,
                 output_padding: int = 0):
        super().__init__()
        shape = (c_in, c_out // groups, kernel) if transposed else (c_out, c_in // groups, kernel)
        self.weight = nn.Parameter(torch.empty(shape))
        self.bias = nn.Parameter(torch.zeros(c_out)) if bias else None
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups
        self.transposed, self.output_padding = transposed, output_padding
        # random weights (benchmarks, tests): the scale of a default torch conv
        fan_in = (c_out if transposed else c_in) // groups * kernel
        nn.init.uniform_(self.weight, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.transposed:
            return F.conv_transpose1d(x, self.weight, self.bias, self.stride, self.padding, self.output_padding,
                                      self.groups, self.dilation)
        return F.conv1d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class _Snake(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))  # the release's shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.snake(x, self.alpha.view(-1))


class _Tanh(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)


class _Noise(nn.Module):
    """x + conv1x1(x) * n with n ~ N(0, 1) [B, 1, T] (shared over channels), or x when off.
    `stream`: this block's noise stream when the noise is counter-based (generator = seeds)."""

    def __init__(self, dim: int, stream: int):
        super().__init__()
        self.linear = _Conv(dim, dim, 1, bias=False)
        self.stream = stream

    def forward(self, x: torch.Tensor, noise: bool, generator) -> torch.Tensor:
        if not noise:
            return x
        if isinstance(generator, torch.Tensor):  # one seed per row
            n = normal_noise(generator, self.stream, x.shape[2]).to(x.dtype).unsqueeze(1)
        elif isinstance(generator, (list, tuple)):  # one generator per row: a row's noise is its own
            n = torch.cat([torch.randn((1, 1, x.shape[2]), generator=g, device=x.device, dtype=x.dtype)
                           for g in generator])
        else:
            n = torch.randn((x.shape[0], 1, x.shape[2]), generator=generator, device=x.device, dtype=x.dtype)
        return x + n * self.linear(x)


class _ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int, groups: int):
        super().__init__()
        self.block = nn.ModuleList([
            _Snake(dim),
            _Conv(dim, dim, 7, dilation=dilation, padding=3 * dilation, groups=groups),  # length kept
            _Snake(dim),
            _Conv(dim, dim, 1),
        ])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for layer in self.block:
            y = layer(y)
        return x + y


class _DecoderBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, rate: int, noise: bool, groups: int, index: int):
        super().__init__()
        layers: list[nn.Module] = [
            _Snake(c_in),
            # kernel 2r, stride r, padding ceil(r/2), output padding r % 2: exactly r x the length
            _Conv(c_in, c_out, 2 * rate, stride=rate, padding=math.ceil(rate / 2), transposed=True,
                  output_padding=rate % 2),
        ]
        if noise:
            layers.append(_Noise(c_out, stream=index))
        layers += [_ResidualUnit(c_out, d, groups) for d in (1, 3, 9)]
        self.block = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, noise: bool, generator: NoiseSource) -> torch.Tensor:
        for layer in self.block:
            x = layer(x, noise, generator) if isinstance(layer, _Noise) else layer(x)
        return x


class _Decoder(nn.Module):
    def __init__(self, cfg: SNACConfig):
        super().__init__()
        latent, dim = cfg.latent, cfg.decoder_dim
        if cfg.attn_window_size is not None:
            # the 32 / 44 kHz models' local attention at the bottleneck is not built here
            raise NotImplementedError("SNAC decoder: attn_window_size must be null (the 24 kHz model)")
        if cfg.depthwise:
            layers: list[nn.Module] = [_Conv(latent, latent, 7, padding=3, groups=latent), _Conv(latent, dim, 1)]
        else:
            layers = [_Conv(latent, dim, 7, padding=3)]
        c = dim
        for i, rate in enumerate(cfg.decoder_rates):
            layers.append(_DecoderBlock(c, c // 2, rate, cfg.noise, groups=c // 2 if cfg.depthwise else 1, index=i))
            c //= 2
        layers += [_Snake(c), _Conv(c, 1, 7, padding=3), _Tanh()]
        self.model = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, noise: bool, generator: NoiseSource) -> torch.Tensor:
        for layer in self.model:
            x = layer(x, noise, generator) if isinstance(layer, _DecoderBlock) else layer(x)
        return x


class _Codebook(nn.Module):
    def __init__(self, size: int, dim: int, latent: int, stride: int):
        super().__init__()
        self.codebook = nn.Embedding(size, dim)
        self.out_proj = _Conv(dim, latent, 1)
        self.stride = stride

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        z = self.out_proj(self.codebook(codes).transpose(1, 2))  # [B, latent, T_i]
        return z.repeat_interleave(self.stride, dim=-1) if self.stride > 1 else z


class _Quantizer(nn.Module):
    def __init__(self, cfg: SNACConfig):
        super().__init__()
        self.quantizers = nn.ModuleList([_Codebook(cfg.codebook_size, cfg.codebook_dim, cfg.latent, s)
                                         for s in cfg.vq_strides])

    def forward(self, codes: list[torch.Tensor]) -> torch.Tensor:
        z = None
        for q, c in zip(self.quantizers, codes):
            zi = q(c)
            z = zi if z is None else z + zi
        return z


class SNACDecoder(nn.Module):
    """codes [B, T * s_0 / s_i] per codebook i -> audio [B, 1, T * s_0 * hop] (see the module
    docstring). Parameters named as the release's state dict with weight norm folded, minus the
    encoder and the quantizers' input projections."""

    def __init__(self, config: SNACConfig | dict):
        super().__init__()
        self.config = config if isinstance(config, SNACConfig) else SNACConfig.from_dict(dict(config))
        cfg = self.config
        if math.prod(cfg.decoder_rates) != cfg.hop_length:
            raise ValueError(f"SNAC config: prod(decoder_rates) {math.prod(cfg.decoder_rates)} != "
                             f"hop {cfg.hop_length}")
        self.quantizer = _Quantizer(cfg)
        self.decoder = _Decoder(cfg)

    @property
    def sampling_rate(self) -> int:
        return self.config.sampling_rate

    @property
    def samples_per_frame(self) -> int:
        return self.config.samples_per_frame

    def check_codes(self, codes: list[torch.Tensor]) -> None:
        strides = self.config.vq_strides
        if len(codes) != len(strides):
            raise ValueError(f"SNAC decode: {len(strides)} codebooks expected, got {len(codes)}")
        lengths = {c.shape[-1] * s for c, s in zip(codes, strides)}
        if len(lengths) != 1 or any(c.dim() != 2 or c.shape[0] != codes[0].shape[0] for c in codes):
            raise ValueError(f"SNAC decode: code shapes {[tuple(c.shape) for c in codes]} do not fit strides {strides}")

    def latent_from_codes(self, codes: list[torch.Tensor]) -> torch.Tensor:
        self.check_codes(codes)
        return self.quantizer([c.to(self.device, torch.long) for c in codes])

    @property
    def device(self) -> torch.device:
        return self.decoder.model[0].weight.device

    @torch.inference_mode()
    def forward(self, codes: list[torch.Tensor], noise: bool = True,
                generator: NoiseSource = None) -> torch.Tensor:
        """audio [B, 1, samples] in the model's dtype. noise=True draws the noise blocks' n as the
        release does, from `generator` (the module docstring lists what it may be; a list of B
        generators or a tensor of B seeds: each row's noise its own, so a row's audio does not
        depend on the batch); noise=False leaves it out."""
        return self.decoder(self.latent_from_codes(codes), noise, generator)


# --- building and loading ----------------------------------------------------------------------
def build_snac_decoder(config: SNACConfig | dict, dtype: torch.dtype = torch.float32,
                       device: str | torch.device = "cpu", seed: int | None = None) -> SNACDecoder:
    """A decoder of random weights (seeded when `seed` is given) in eval mode."""
    if seed is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = SNACDecoder(config)
    else:
        model = SNACDecoder(config)
    return model.to(device=device, dtype=dtype).eval()


def _fold(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """g * v / ||v||, the norm over the dims where g has size 1 (torch's weight_norm keeps g's
    rank: [out, 1, 1] for dim=0; a 0-d g: dim=None, the whole tensor), computed in float64."""
    dims = list(range(v.dim())) if g.dim() == 0 else [d for d in range(v.dim()) if g.shape[d] == 1]
    if not dims:
        raise ValueError(f"SNAC checkpoint: weight-norm g of shape {tuple(g.shape)} for v {tuple(v.shape)}")
    v64 = v.double()
    return (g.double() * v64 / v64.pow(2).sum(dim=dims, keepdim=True).sqrt()).to(v.dtype)


_WN_NAMES = ((".parametrizations.weight.original0", ".parametrizations.weight.original1"), (".weight_g", ".weight_v"))


def fold_weight_norm(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with every weight-normed pair replaced by its plain `weight`: the names of
    torch.nn.utils.parametrizations.weight_norm (`parametrizations.weight.original0` = g,
    `original1` = v; what the snac package saves) and of the older torch.nn.utils.weight_norm
    (`weight_g`, `weight_v`)."""
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        for g_suffix, v_suffix in _WN_NAMES:
            if key.endswith(v_suffix):
                if key[: -len(v_suffix)] + g_suffix not in state:
                    raise KeyError(f"SNAC checkpoint: {key} without its g")
                break
            if key.endswith(g_suffix):
                prefix = key[: -len(g_suffix)]
                if prefix + v_suffix not in state:
                    raise KeyError(f"SNAC checkpoint: {key} without its v")
                out[prefix + ".weight"] = _fold(t, state[prefix + v_suffix])
                break
        else:
            out[key] = t
    return out


def decoder_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The part of a full SNAC state dict the decoder reads, weight norm folded: `quantizer.*`
    without the input projections (encode side), and `decoder.*`; `encoder.*` is dropped."""
    keep = {k: v for k, v in state.items()
            if k.startswith("decoder.") or (k.startswith("quantizer.") and ".in_proj." not in k)}
    return fold_weight_norm(keep)


def read_snac_config(path: str) -> SNACConfig:
    with open(os.path.join(path, "config.json")) as f:
        return SNACConfig.from_dict(json.load(f))


def load_snac_decoder(path: str, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> SNACDecoder:
    """A decoder from a directory in the release's layout: config.json (SNAC's constructor
    arguments) and pytorch_model.bin (SNAC.state_dict()). Every decoder parameter must be there."""
    cfg = read_snac_config(path)
    state = torch.load(os.path.join(path, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    model = SNACDecoder(cfg)
    missing, unexpected = model.load_state_dict(decoder_state_dict(state), strict=False)
    if missing or unexpected:
        raise ValueError(f"SNAC checkpoint {path!r}: missing {sorted(missing)[:8]}, "
                         f"unexpected {sorted(unexpected)[:8]}")
    return model.to(device=device, dtype=dtype).eval()
