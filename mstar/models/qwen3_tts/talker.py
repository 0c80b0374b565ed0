"""The Qwen3-TTS talker on mstar.ops, and the paged K/V its rows attend over.

The talker is a Qwen3 decoder (per-head q/k RMSNorm, GQA, SwiGLU, pre-norm) whose input at each
position is a sum of embeddings instead of one token's:

    text part    text_projection(text_embedding(text id)): a two-layer SiLU MLP from the text
                 model's width to the talker's
    codec part   codec_embedding(codec id): a control id (think tags, language, speaker, pad, bos)
                 in the prompt; during generation, the previous frame's 16 codes (codebook 0 from
                 this table, codebooks 1..15 from the code predictor's tables), summed
    codec_head   hidden -> logits of codebook 0 (and the control ids, EOS among them)

Rotary: the release configures three position axes (temporal, height, width) whose frequency bands
are interleaved ("mrope_section", "interleaved"). Speech from text gives every token the same
position on all three axes, and then each band reads the same cos / sin whichever axis it takes it
from: the result is plain NeoX rotary over the whole head at the token's position, which is what
this module applies (ops.qk_norm_rope); the tests compare it with the reference's three-axis code.

`KVPool` holds the K/V pages of the talker's attention layers (bound to them), `PageTable` the
pages and lengths of one batch of rows and the attention metadata of a step: prefill of new rows
(`add_rows`) or one decode token per row (`advance`). Index arrays are built on the host with
numpy; indptr and last-page lengths stay on the host (the attention backends plan from them
without reading the device), page indices, KV slots and positions go to the model's device.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mstar.models.context import AttentionLayerSpec, AttentionMetadata, ForwardContext
from mstar.models.layers import Embedding, Linear, QKNormAttention, RMSNorm, RotaryCache
from mstar.models.qwen3_tts.code_predictor import CodePredictor, decoder_layer, run_decoder
from mstar.models.qwen3_tts.config import TalkerConfig


class TextProjection(nn.Module):
    """linear_fc2(silu(linear_fc1(x))), both with bias: text width -> talker width."""

    def __init__(self, text_hidden: int, hidden: int):
        super().__init__()
        self.linear_fc1 = Linear(text_hidden, text_hidden, bias=True)
        self.linear_fc2 = Linear(text_hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class TalkerModel(nn.Module):
    """What checkpoints call `talker.model.*`."""

    def __init__(self, c: TalkerConfig):
        super().__init__()
        self.codec_embedding = Embedding(c.vocab_size, c.hidden_size)
        self.text_embedding = Embedding(c.text_vocab_size, c.text_hidden_size)
        self.layers = nn.ModuleList(decoder_layer(c.hidden_size, c.intermediate_size, c.num_attention_heads,
                                                  c.num_key_value_heads, c.head_dim, c.rms_norm_eps,
                                                  c.attention_bias) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Talker(nn.Module):
    """`talker.*` of the checkpoint: the decoder, the text projection, the codebook-0 head and the
    code predictor (`code_predictor`)."""

    def __init__(self, config: TalkerConfig):
        super().__init__()
        self.config = config
        self.model = TalkerModel(config)
        self.text_projection = TextProjection(config.text_hidden_size, config.hidden_size)
        self.codec_head = Linear(config.hidden_size, config.vocab_size)
        self.code_predictor = CodePredictor(config.code_predictor_config, config.hidden_size)
        self.rope = RotaryCache(config.max_position_embeddings, config.head_dim, config.rope_theta)

    @property
    def attention_layers(self) -> list[QKNormAttention]:
        return [layer.self_attn for layer in self.model.layers]

    def memory_specs(self) -> list[AttentionLayerSpec]:
        """Paged K/V per attention layer (what one token of a row costs)."""
        return [a.spec() for a in self.attention_layers]

    def text_embeds(self, ids: torch.Tensor) -> torch.Tensor:
        """The text part of an input position: [N] text ids -> [N, hidden]."""
        return self.text_projection(self.model.text_embedding(ids))

    def prompt_embeds(self, text_ids: torch.Tensor, codec_ids: torch.Tensor) -> torch.Tensor:
        """Prompt positions: text part + codec part (codec id < 0: none). [N], [N] -> [N, hidden]."""
        x = self.text_embeds(text_ids)
        has = codec_ids >= 0
        return torch.where(has.unsqueeze(1), x + self.model.codec_embedding(codec_ids.clamp(min=0)), x)

    def frame_embeds(self, codes: torch.Tensor) -> torch.Tensor:
        """The codec part of the position after a frame: its [B, G] codes' embeddings, summed."""
        parts = torch.cat([self.model.codec_embedding(codes[:, :1]), self.code_predictor.embed_codes(codes[:, 1:])], 1)
        return parts.sum(1)

    def forward(self, ctx: ForwardContext, embeds: torch.Tensor) -> torch.Tensor:
        """[T, hidden] input embeddings (the step's tokens, context.py's layout) -> hidden after the norm."""
        return run_decoder(self.model.layers, self.model.norm, ctx, embeds, self.rope)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Codebook-0 logits, float32 [N, vocab]."""
        return self.codec_head(hidden).float()


class KVPool:
    """K/V pages [num_pages, page_size, Hkv, D] per talker attention layer, bound to the layers, and
    the list of free pages."""

    def __init__(self, talker: Talker, num_pages: int, page_size: int = 16, *, device=None,
                 dtype: torch.dtype | None = None):
        ref = talker.codec_head.weight
        device, dtype = device or ref.device, dtype or ref.dtype
        self.page_size, self.num_pages, self.device = int(page_size), int(num_pages), torch.device(device)
        self.k, self.v = [], []
        for a in talker.attention_layers:
            shape = (self.num_pages, self.page_size, a.num_kv_heads, a.head_dim)
            a.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            a.v_cache = torch.zeros(shape, dtype=dtype, device=device)
            self.k.append(a.k_cache)
            self.v.append(a.v_cache)
        self._free = list(range(self.num_pages - 1, -1, -1))  # a stack: low pages first

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, tokens: int) -> int:
        return -(-int(tokens) // self.page_size)

    def take(self, n: int) -> np.ndarray:
        if n > len(self._free):
            raise RuntimeError(f"qwen3-tts talker: out of KV pages ({n} wanted, {len(self._free)} free of "
                               f"{self.num_pages})")
        if n == 0:
            return np.zeros(0, dtype=np.int32)
        out = np.asarray(self._free[-n:][::-1], dtype=np.int32)
        del self._free[-n:]
        return out

    def give(self, pages: np.ndarray) -> None:
        self._free.extend(np.asarray(pages, dtype=np.int64)[::-1].tolist())


def _host(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int32))


class PageTable:
    """The talker pages of one batch of rows: table[r, :n_pages[r]] are row r's pages in order,
    lens[r] the tokens in its cache."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.table = np.zeros((0, 1), dtype=np.int32)
        self.n_pages = np.zeros(0, dtype=np.int64)
        self.lens = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.lens)

    def _widen(self, cols: int) -> None:
        if cols > self.table.shape[1]:
            grow = max(cols, 2 * self.table.shape[1]) - self.table.shape[1]
            self.table = np.pad(self.table, ((0, 0), (0, grow)), constant_values=-1)

    def _to_dev(self, x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x)).to(device=self.pool.device, dtype=dtype, non_blocking=True)

    def _indices(self, rows: slice) -> np.ndarray:
        t, n = self.table[rows], self.n_pages[rows]
        return t[np.arange(t.shape[1])[None, :] < n[:, None]]

    def _slots(self, rows: np.ndarray, pos: np.ndarray) -> np.ndarray:
        ps = self.pool.page_size
        return self.table[rows, pos // ps].astype(np.int64) * ps + pos % ps

    def add_rows(self, lengths) -> tuple[torch.Tensor, AttentionMetadata]:
        """Append rows with prompts of `lengths` tokens: (positions [T], the prefill metadata of those
        rows' tokens alone, in row order)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        ps, k, first = self.pool.page_size, len(lengths), len(self)
        n = -(-lengths // ps)
        pages = self.pool.take(int(n.sum()))
        self._widen(int(n.max(initial=1)))
        new = np.full((k, self.table.shape[1]), -1, dtype=np.int32)
        new[np.arange(new.shape[1])[None, :] < n[:, None]] = pages
        self.table = np.concatenate([self.table, new])
        self.n_pages = np.concatenate([self.n_pages, n])
        self.lens = np.concatenate([self.lens, lengths])
        starts = np.concatenate([[0], np.cumsum(lengths)])
        pos = np.arange(starts[-1]) - np.repeat(starts[:-1], lengths)
        rows = first + np.repeat(np.arange(k), lengths)
        md = AttentionMetadata(
            slot_mapping=self._to_dev(self._slots(rows, pos), torch.int64),
            decode_kv_indptr=_host(np.zeros(1)), decode_kv_indices=self._to_dev(np.zeros(0), torch.int32),
            decode_kv_last_page_len=_host(np.zeros(0)), prefill_qo_indptr=_host(starts),
            prefill_kv_indptr=_host(np.concatenate([[0], np.cumsum(n)])),
            prefill_kv_indices=self._to_dev(pages, torch.int32), prefill_kv_last_page_len=_host(lengths - (n - 1) * ps))
        return self._to_dev(pos, torch.int64), md

    def advance(self, pad_to: int = 0, pad_page: int = 0) -> tuple[torch.Tensor, AttentionMetadata]:
        """One new token per row (pages taken where a row's last page is full): (positions [B], the
        decode metadata of the step). pad_to > B: as many rows in all, the extra ones padding rows
        (position 0 of page `pad_page`, one token)."""
        ps, B = self.pool.page_size, len(self)
        pos = self.lens.copy()
        need = pos // ps >= self.n_pages
        if need.any():
            rows = np.nonzero(need)[0]
            self._widen(int(self.n_pages.max()) + 1)
            self.table[rows, self.n_pages[rows]] = self.pool.take(len(rows))
            self.n_pages[rows] += 1
        self.lens += 1
        slots, n_pages, indices = self._slots(np.arange(B), pos), self.n_pages, self._indices(slice(None))
        last = self.lens - (self.n_pages - 1) * ps
        pad = max(0, int(pad_to) - B)
        if pad:
            pos = np.concatenate([pos, np.zeros(pad, np.int64)])
            slots = np.concatenate([slots, np.full(pad, pad_page * ps, np.int64)])
            n_pages = np.concatenate([n_pages, np.ones(pad, np.int64)])
            indices = np.concatenate([indices, np.full(pad, pad_page, np.int32)])
            last = np.concatenate([last, np.ones(pad, np.int64)])
        md = AttentionMetadata(
            slot_mapping=self._to_dev(slots, torch.int64),
            decode_kv_indptr=_host(np.concatenate([[0], np.cumsum(n_pages)])),
            decode_kv_indices=self._to_dev(indices, torch.int32), decode_kv_last_page_len=_host(last),
            prefill_qo_indptr=_host(np.zeros(1)), prefill_kv_indptr=_host(np.zeros(1)),
            prefill_kv_indices=self._to_dev(np.zeros(0), torch.int32), prefill_kv_last_page_len=_host(np.zeros(0)))
        return self._to_dev(pos, torch.int64), md

    def pages_needed_by_advance(self) -> int:
        """Pages the next `advance` takes (rows whose last page is full)."""
        return int((self.lens // self.pool.page_size >= self.n_pages).sum())

    def remove_rows(self, rows) -> None:
        """Drop `rows` (positions), returning their pages to the pool; the others keep their order."""
        rows = np.asarray(sorted(set(int(r) for r in rows)), dtype=np.int64)
        if rows.size == 0:
            return
        keep = np.ones(len(self), dtype=bool)
        keep[rows] = False
        self.pool.give(self._indices(~keep))
        self.table, self.n_pages, self.lens = self.table[keep], self.n_pages[keep], self.lens[keep]
