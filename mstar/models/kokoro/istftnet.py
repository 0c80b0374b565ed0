"""Kokoro's decoder: StyleTTS2's AdaIN res-block stack over the frame-aligned text features, F0
and energy, then an iSTFTNet generator.

    Decoder     F0 / N curves (twice the frame rate) strided back to the frame rate; encode:
                AdainResBlk1d(hidden + 2 -> decoder_dim); decode: 4 AdainResBlk1d, each fed the
                features again with F0, N and a 1x1 projection of the text features (decoder_res_dim
                channels), the last one upsampling 2x to upsample_initial_channel
    Generator   per upsampling i: LeakyReLU(0.1), transposed conv, plus the harmonic source's
                STFT (magnitude and phase) through a strided conv and an AdaIN res-block;
                then the mean of the AdaIN res-blocks (Snake activations), LeakyReLU, conv to
                n_fft + 2 channels: log-magnitude and phase (sin) of an STFT, inverted by iSTFT

Rows are batched with masks (blocks.py); the STFT of the source and the final iSTFT run per row
(each row's own frames: a batched iSTFT would normalise a row's last samples by padding frames'
windows). Both run in float32. The source's first STFT frame is made exactly real (_stft): the
release leaves the phase of its negative bins to rounding (+pi or -pi).

Parameter names follow the release's `decoder` state dict (encode, decode.<i>, F0_conv, N_conv,
asr_res.0, generator.{m_source.l_linear, noise_convs, noise_res, ups, resblocks, conv_post});
weight-normed convs there are folded to plain weights at load.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mstar.models.kokoro.blocks import AdaIN1d, AdainResBlk1d, conv_out_len, conv_t_out_len, length_mask
from mstar.models.kokoro.source import HarmonicSource


def _same_pad(kernel: int, dilation: int = 1) -> int:
    return (kernel * dilation - dilation) // 2


class AdaINResBlock1(nn.Module):
    """HiFi-GAN's ResBlock1 with AdaIN before each conv and Snake activations:
    x += conv2(snake(adain2(conv1_d(snake(adain1(x)))))) for each dilation d."""

    def __init__(self, channels: int, kernel_size: int, dilations, style_dim: int):
        super().__init__()
        self.convs1 = nn.ModuleList([nn.Conv1d(channels, channels, kernel_size, 1, dilation=d,
                                               padding=_same_pad(kernel_size, d)) for d in dilations])
        self.convs2 = nn.ModuleList([nn.Conv1d(channels, channels, kernel_size, 1, dilation=1,
                                               padding=_same_pad(kernel_size)) for _ in dilations])
        self.adain1 = nn.ModuleList([AdaIN1d(style_dim, channels) for _ in dilations])
        self.adain2 = nn.ModuleList([AdaIN1d(style_dim, channels) for _ in dilations])
        self.alpha1 = nn.ParameterList([nn.Parameter(torch.ones(1, channels, 1)) for _ in dilations])
        self.alpha2 = nn.ParameterList([nn.Parameter(torch.ones(1, channels, 1)) for _ in dilations])

    def forward(self, x: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        for c1, c2, n1, n2, a1, a2 in zip(self.convs1, self.convs2, self.adain1, self.adain2, self.alpha1, self.alpha2):
            h = c1(n1.act(x, s, m, alpha=a1.view(-1)))  # (masked)
            x = c2(n2.act(h, s, m, alpha=a2.view(-1))) + x
        return x


def _stft(x: torch.Tensor, n_fft: int, hop: int, window: torch.Tensor) -> torch.Tensor:
    """One row's STFT (centred, reflect-padded): [n_fft + 2, frames]: magnitudes, then phases.

    The first frame is real in exact arithmetic (the reflect padding mirrors the signal about the
    window's centre), so its negative bins sit on the phase's branch cut and rounding noise in the
    imaginary part picks +pi or -pi at random: a 2 pi step into the generator. Its imaginary part
    is set to exactly 0 here, making those phases pi, the exact value, in every batch."""
    spec = torch.stft(x, n_fft, hop, n_fft, window=window, return_complex=True)
    spec[:, 0] = torch.complex(spec[:, 0].real, torch.zeros_like(spec[:, 0].real))
    return torch.cat([spec.abs(), spec.angle()], dim=0)


class Generator(nn.Module):
    def __init__(self, style_dim: int, resblock_kernel_sizes, upsample_rates, upsample_initial_channel: int,
                 resblock_dilation_sizes, upsample_kernel_sizes, gen_istft_n_fft: int, gen_istft_hop_size: int,
                 sample_rate: int):
        super().__init__()
        self.num_kernels = len(resblock_kernel_sizes)
        self.n_fft, self.hop = int(gen_istft_n_fft), int(gen_istft_hop_size)
        self.source_scale = math.prod(upsample_rates) * self.hop
        self.m_source = HarmonicSource(sample_rate, self.source_scale)
        self.noise_convs = nn.ModuleList()
        self.noise_res = nn.ModuleList()
        self.ups = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        ch = upsample_initial_channel
        for i, (u, k) in enumerate(zip(upsample_rates, upsample_kernel_sizes)):
            ch = upsample_initial_channel // (2 ** (i + 1))
            self.ups.append(nn.ConvTranspose1d(2 * ch, ch, k, u, padding=(k - u) // 2))
            for rk, rd in zip(resblock_kernel_sizes, resblock_dilation_sizes):
                self.resblocks.append(AdaINResBlock1(ch, rk, rd, style_dim))
            if i + 1 < len(upsample_rates):
                stride = math.prod(upsample_rates[i + 1:])
                self.noise_convs.append(nn.Conv1d(self.n_fft + 2, ch, stride * 2, stride, padding=(stride + 1) // 2))
                self.noise_res.append(AdaINResBlock1(ch, 7, (1, 3, 5), style_dim))
            else:
                self.noise_convs.append(nn.Conv1d(self.n_fft + 2, ch, 1))
                self.noise_res.append(AdaINResBlock1(ch, 11, (1, 3, 5), style_dim))
        self.conv_post = nn.Conv1d(ch, self.n_fft + 2, 7, 1, padding=3)
        self.register_buffer("window", torch.hann_window(self.n_fft, periodic=True), persistent=False)

    def forward(self, x: torch.Tensor, s: torch.Tensor, f0: torch.Tensor, lengths: torch.Tensor,
                generators: list) -> list[torch.Tensor]:
        """x [B, C0, T] (rows of `lengths`, host), s [B, style], f0 [B, T] (Hz; same rate as x) ->
        one waveform per row, float32 [lengths[b] * prod(upsample_rates) * hop]."""
        dev, B = x.device, x.shape[0]
        window = self.window.to(device=dev, dtype=torch.float32)
        # the harmonic source, then its STFT per row (frames = samples // hop + 1)
        f0_up = F.interpolate(f0.float()[:, None], scale_factor=float(self.source_scale), mode="nearest")[:, 0]
        n_src = [int(n) * self.source_scale for n in lengths.tolist()]
        src = self.m_source(f0_up, n_src, generators)
        frames = torch.tensor([n // self.hop + 1 for n in n_src])
        har = src.new_zeros(B, self.n_fft + 2, int(frames.max()))
        for b, n in enumerate(n_src):
            har[b, :, :int(frames[b])] = _stft(src[b, :n], self.n_fft, self.hop, window)
        har = har.to(x.dtype)
        har_m = length_mask(frames, har.shape[-1], x.dtype, dev)
        n, m = lengths, length_mask(lengths, x.shape[-1], x.dtype, dev)
        for i, up in enumerate(self.ups):
            x = F.leaky_relu(x, 0.1)
            nc = self.noise_convs[i]
            ns = conv_out_len(frames, nc)
            xs_m = length_mask(ns, int(conv_out_len(torch.tensor(har.shape[-1]), nc)), x.dtype, dev)
            xs = self.noise_res[i](nc(har * har_m), s, xs_m)
            x = up(x * m)
            n = conv_t_out_len(n, up)
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")  # the release's ReflectionPad1d((1, 0))
                n = n + 1
            if not torch.equal(n, ns):
                raise ValueError(f"generator: upsampled frames {n.tolist()} != source frames {ns.tolist()}")
            T = min(x.shape[-1], xs.shape[-1])
            m = length_mask(n, T, x.dtype, dev)
            x = x[..., :T] + xs[..., :T]
            acc = None
            for j in range(self.num_kernels):
                r = self.resblocks[i * self.num_kernels + j](x, s, m)
                acc = r if acc is None else acc + r
            x = acc / self.num_kernels
        x = self.conv_post(F.leaky_relu(x, 0.01) * m).float()
        nb = self.n_fft // 2 + 1
        out = []
        for b in range(B):
            t = int(n[b])
            spec = torch.exp(x[b, :nb, :t]) * torch.exp(1j * torch.sin(x[b, nb:, :t]))
            out.append(torch.istft(spec, self.n_fft, self.hop, self.n_fft, window=window))
        return out


class Decoder(nn.Module):
    def __init__(self, dim_in: int, style_dim: int, istftnet: dict, decoder_dim: int = 1024, res_dim: int = 64,
                 sample_rate: int = 24000):
        super().__init__()
        c0 = int(istftnet["upsample_initial_channel"])
        self.encode = AdainResBlk1d(dim_in + 2, decoder_dim, style_dim)
        cat = decoder_dim + 2 + res_dim
        self.decode = nn.ModuleList([AdainResBlk1d(cat, decoder_dim, style_dim) for _ in range(3)]
                                    + [AdainResBlk1d(cat, c0, style_dim, upsample=True)])
        self.F0_conv = nn.Conv1d(1, 1, 3, stride=2, padding=1)
        self.N_conv = nn.Conv1d(1, 1, 3, stride=2, padding=1)
        self.asr_res = nn.ModuleList([nn.Conv1d(dim_in, res_dim, 1)])
        self.generator = Generator(style_dim, istftnet["resblock_kernel_sizes"], istftnet["upsample_rates"], c0,
                                   istftnet["resblock_dilation_sizes"], istftnet["upsample_kernel_sizes"],
                                   istftnet["gen_istft_n_fft"], istftnet["gen_istft_hop_size"], sample_rate)

    def forward(self, asr: torch.Tensor, f0: torch.Tensor, n_curve: torch.Tensor, s: torch.Tensor,
                frames: torch.Tensor, generators: list) -> list[torch.Tensor]:
        """asr [B, dim_in, F] text features per frame, f0 / n_curve [B, 2F], frames [B] (host) ->
        one waveform per row."""
        dev, dt = asr.device, asr.dtype
        m = length_mask(frames, asr.shape[-1], dt, dev)
        m2 = length_mask(2 * frames, f0.shape[-1], dt, dev)[:, 0]
        f0_in, n_in = f0 * m2, n_curve * m2
        F0 = self.F0_conv(f0_in[:, None])[..., :asr.shape[-1]]
        N = self.N_conv(n_in[:, None])[..., :asr.shape[-1]]
        x, _ = self.encode(torch.cat([asr, F0, N], dim=1), s, m)
        res = self.asr_res[0](asr)
        hm, inject = m, True
        for block in self.decode:
            if inject:  # the text features, F0 and N go in again up to the upsampling block
                x = torch.cat([x, res, F0, N], dim=1)
            x, hm = block(x, s, hm)
            inject = inject and not block.upsample
        return self.generator(x, s, f0_in, 2 * frames, generators)


__all__ = ["AdaINResBlock1", "Generator", "Decoder"]
