"""Batch sampling state: per-row parameters and penalty bookkeeping kept as device tensors.

Each running sequence owns a row (0..max_rows-1) for as long as it holds a cache slot.
At admission the row's parameters are written once; a step gathers the rows it samples
with one index tensor (no per-step rebuild from Python lists) and calls `ops.sample`.

Penalties: `prompt_mask [rows, V] bool` and `output_counts [rows, V] int32` are allocated
on first use (a request with a repetition / presence / frequency penalty) and updated
incrementally: the prompt mask once at admission, the counts with one scatter-add of the
tokens sampled each step. Only rows that use penalties are read or written.

min_tokens: the stop ids (eos unless ignore_eos, stop_token_ids) of rows that have not
reached min_tokens are masked to -inf before sampling (one indexed write).

Randomness: `ops.sample` is counter-based on (seed, step) with step = the index of the
output token being drawn, so a sequence's tokens do not depend on the batch around it.

The path per step is chosen on the host, from host mirrors of the parameters (no device
sync): an all-greedy batch takes `greedy_sample`; otherwise, when `sample`'s selected backend
is `torch_topk` (or another of `sampling.PLANNED_BACKENDS`), `sampling.make_plan` +
`sampling.sample_planned` (no full-vocabulary sort, no host sync). The rows it flags as
undecided (rare) come back with the tokens, in the one readback the step already has, and are
redone by `sampling.redo_rows` (more candidates, then the reference). Any other selection
(`MSTAR_BACKENDS=sample=reference`, verify mode) calls `ops.sample` itself.

In-graph decode inputs (MSTAR_INGRAPH_DECODE_TOKENS): with `masters` set (the engine sets it
once at build, only for a model that reads its decode inputs on the device), `sample` also
takes each row's master slot (uploaded with the rows and steps, in the same copy) and
scatters the sampled tokens into the token master on the device (no sync). Without it
nothing of this runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mstar import knobs, ops
from mstar.ops import sampling
from mstar.runtime.engine.request import SamplingParams, TokenLogprobs

LOGPROB_FLOOR = -9999.0  # what a logprob of -inf or NaN is reported as

# columns of the float parameter table
_T, _TOP_P, _MIN_P, _REP, _PRES, _FREQ = range(6)
# columns of the int parameter table
_TOP_K, _SEED = range(2)


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[TokenLogprobs | None] | None  # per sampled row; None when no row asked


class Sampler:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device | str):
        self.max_rows = max_rows
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.fparams = torch.zeros((6, max_rows), dtype=torch.float32, device=self.device)
        self.iparams = torch.zeros((2, max_rows), dtype=torch.int64, device=self.device)
        # host mirrors of what decides the per-step path
        self._uses_penalty = np.zeros(max_rows, dtype=bool)
        self._num_logprobs = np.full(max_rows, -1, dtype=np.int64)  # -1: no logprobs
        self._greedy = np.zeros(max_rows, dtype=bool)
        # temperature, top_p, min_p as float32 (the device's values) and top_k: the plan's inputs
        self._fhost = np.zeros((3, max_rows), dtype=np.float32)
        self._top_k = np.zeros(max_rows, dtype=np.int64)
        self._free = list(range(max_rows - 1, -1, -1))
        self.prompt_mask: torch.Tensor | None = None
        self.output_counts: torch.Tensor | None = None
        # DecodeMasters (decode_masters.py) the sampled tokens are scattered into; None: off
        self.masters = None

    # --- rows --------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @staticmethod
    def row_values(params: SamplingParams, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A row's float and int parameters as host tensors. The engine builds them when a request
        is added, so a value the tables cannot hold fails that request there, never a step."""
        fp = torch.tensor([params.temperature, params.top_p, params.min_p, params.repetition_penalty,
                           params.presence_penalty, params.frequency_penalty], dtype=torch.float32)
        ip = torch.tensor([params.top_k, seed & 0x7FFFFFFFFFFFFFFF], dtype=torch.int64)
        return fp, ip

    def add(self, params: SamplingParams, seed: int, prompt_ids: list[int], output_ids: list[int],
            values: tuple[torch.Tensor, torch.Tensor] | None = None) -> int:
        """Take a row for a sequence and write its parameters (`values`: row_values(params, seed),
        built beforehand); returns the row."""
        fp, ip = values if values is not None else self.row_values(params, seed)
        row = self._free.pop()
        self.fparams[:, row] = fp.to(self.device, non_blocking=True)
        self.iparams[:, row] = ip.to(self.device, non_blocking=True)
        pen = (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
               or params.frequency_penalty != 0.0)
        self._uses_penalty[row] = pen
        self._num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self._greedy[row] = params.temperature <= 0
        self._fhost[:, row] = fp[[_T, _TOP_P, _MIN_P]].numpy()
        self._top_k[row] = params.top_k
        if pen:
            self._ensure_penalty_tensors()
            self.prompt_mask[row].zero_()
            self.output_counts[row].zero_()
            if prompt_ids:
                ids = torch.tensor(prompt_ids, dtype=torch.int64).to(self.device, non_blocking=True)
                self.prompt_mask[row].index_fill_(0, ids, True)
            if output_ids:  # a recomputed / reloaded sequence brings its history
                ids = torch.tensor(output_ids, dtype=torch.int64).to(self.device, non_blocking=True)
                self.output_counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        return row

    def plain_greedy(self, row: int) -> bool:
        """The row's token is the argmax of its logits: greedy, no penalties, no logprobs."""
        return bool(self._greedy[row] and not self._uses_penalty[row] and self._num_logprobs[row] < 0)

    def release(self, row: int) -> None:
        if row < 0:
            return
        self._uses_penalty[row] = False
        self._num_logprobs[row] = -1
        self._free.append(row)

    def _ensure_penalty_tensors(self) -> None:
        if self.prompt_mask is None:
            self.prompt_mask = torch.zeros((self.max_rows, self.vocab_size), dtype=torch.bool, device=self.device)
            self.output_counts = torch.zeros((self.max_rows, self.vocab_size), dtype=torch.int32,
                                             device=self.device)

    # --- the step ----------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, rows: list[int], steps: list[int],
               masked: list[tuple[int, list[int]]] | None = None, slots: list[int] | None = None) -> SampleResult:
        """Sample one token for each row of `logits` [B, V].

        rows[b]: the sampler row of logits row b; steps[b]: the index of the output token
        drawn (= tokens generated so far); masked: (b, ids) pairs whose ids must not be drawn;
        slots[b]: the decode master slot of row b (only with `masters` set: the token is
        written there on the device).
        """
        B = logits.shape[0]
        V = logits.shape[1]
        scatter = self.masters is not None and slots is not None
        host = np.empty((3 if scatter else 2, B), dtype=np.int64)
        host[0] = rows
        host[1] = steps
        if scatter:
            host[2] = slots
        idx = torch.from_numpy(host)
        if self.device.type != "cpu":
            idx = idx.to(self.device, non_blocking=True)
        row_t, step_t = idx[0], idx[1]
        fp = self.fparams[:, row_t]  # [6, B], each row contiguous
        ip = self.iparams[:, row_t]

        rows_np = host[0]
        pen = self._uses_penalty[rows_np]
        if pen.any():
            logits = logits.float()
            b_idx = np.nonzero(pen)[0]
            if len(b_idx) == B:
                sel, pr = slice(None), row_t
            else:
                sel = torch.from_numpy(b_idx).to(self.device, non_blocking=True)
                pr = row_t[sel]
            out = ops.apply_penalties(logits[sel], self.prompt_mask[pr], self.output_counts[pr],
                                      fp[_REP][sel], fp[_PRES][sel], fp[_FREQ][sel])
            if len(b_idx) == B:
                logits = out
            else:
                logits[sel] = out
        if masked:
            # logits is this step's own tensor (compute_logits output): written in place
            ti = [t for _, ids in masked for t in ids if t < V]
            bi = [b for b, ids in masked for t in ids if t < V]
            if ti:
                m = torch.tensor([bi, ti], dtype=torch.int64).to(self.device, non_blocking=True)
                logits[m[0], m[1]] = float("-inf")

        nlp = self._num_logprobs[rows_np]
        n_top = int(nlp.max()) if B else -1
        plan = None
        greedy = self._greedy[rows_np].all()
        if greedy and n_top < 0:  # argmax only: no softmax over the vocabulary
            tokens, tok_lp, top_ids, top_lp = logits.argmax(dim=-1), None, None, None
        elif greedy:  # no sort over the vocabulary for an all-greedy batch
            tokens, tok_lp, top_ids, top_lp = ops.greedy_sample(logits, max(n_top, 0))
        else:
            args = (logits, fp[_T], ip[_TOP_K], fp[_TOP_P], fp[_MIN_P], ip[_SEED], step_t)
            backend = ops.sample.selected(self.device.type)
            if backend in sampling.PLANNED_BACKENDS and not knobs.value("MSTAR_VERIFY"):
                plan = sampling.make_plan(self._fhost[0, rows_np], self._top_k[rows_np], self._fhost[1, rows_np],
                                          self._fhost[2, rows_np], V)
                out = sampling.sample_planned(*args, max(n_top, 0), plan, sampling.PLANNED_BACKENDS[backend],
                                              token_logprobs=n_top >= 0)
                tokens, tok_lp, top_ids, top_lp, _ = out
            else:
                tokens, tok_lp, top_ids, top_lp = ops.sample(*args, max(n_top, 0))

        if plan is not None and not plan.complete:
            # the exact flags come back with the tokens, in the same copy
            tok_list, ok = torch.stack([tokens, out[4].to(torch.int64)]).tolist()
            bad = [b for b in range(B) if not ok[b]]
            if bad:  # rare: rows the fast stages could not decide (extra syncs only here)
                for b, t in zip(bad, sampling.redo_rows(out, bad, *args).tolist()):
                    tok_list[b] = t
            if scatter:  # after redo_rows, which rewrites the redone rows of `tokens` in place
                self.masters.scatter_tokens(idx[2], tokens)
        else:
            if scatter:  # queued before the read-back
                self.masters.scatter_tokens(idx[2], tokens)
            tok_list = tokens.tolist()

        if pen.any():
            b_idx = torch.from_numpy(np.nonzero(pen)[0]).to(self.device, non_blocking=True)
            self.output_counts.index_put_((row_t[b_idx], tokens[b_idx]),
                                          torch.ones(b_idx.shape[0], dtype=torch.int32, device=self.device),
                                          accumulate=True)

        lps = None
        if n_top >= 0:
            # -inf (a masked token) and NaN (arithmetic that left float32) as OpenAI's -9999.0:
            # JSON has no infinities, and no response may carry a NaN
            lp_l = torch.nan_to_num(tok_lp, nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR).tolist()
            ids_l = top_ids.tolist()
            tlp_l = torch.nan_to_num(top_lp, nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR).tolist()
            lps = []
            for b in range(B):
                n = int(nlp[b])
                lps.append(None if n < 0 else TokenLogprobs(lp_l[b], ids_l[b][:n], tlp_l[b][:n]))
        return SampleResult(tok_list, lps)
