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
redone by `sampling.redo_rows` (more candidates, then the reference). A step whose rows a
family's constraint leaves at most `max_finite` finite logits (EngineHooks.max_allowed_tokens)
plans a candidate stage of that size: complete, nothing undecided. Any other selection
(`MSTAR_BACKENDS=sample=reference`, verify mode) calls `ops.sample` itself.

On the device (overlapped decode, decode_overlap.py): `sample_device` returns the tokens `sample`
draws for the same rows, left on the device, reading nothing back; `on_device` says which rows it
takes (no logprobs; sampled rows only when the selected path has no host sync: the Sampler's plan,
or the reference op). It shares `sample`'s steps (one upload of rows and steps, the penalties, the
plan, the output counts) and differs where `sample` reads the exact flags: with an incomplete plan
the rows of a candidate stage also get the reference's token (a full sort of those rows), taken
where the flag is false. `sample` redoes such a row on 16384 candidates before the reference; the
two agree except within float rounding of a top-p / min-p boundary (sampling.py), and only on a
row the first candidates left undecided. masked ids (min_tokens, a first token's suppression
list) are `sample`'s only.

Candidate columns (MSTAR_CANDIDATE_SAMPLING): `col_ids` [B, M] says that logits column j of row b
is token col_ids[b, j] (the row's candidates, ascending, -1 padding with a -inf logit): penalties
read their masks and counts at those ids, the draw is one stable sort of the M columns with the
noise keyed on the ids (sampling.whole_row_plan), and the tokens are mapped back to ids before
anything else sees them. No logprobs and no masked ids on this path (the engine takes it only
without them).

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
# sample_device with an incomplete plan sorts the vocabulary of every candidate-stage row as well:
# on_device takes at most this many such rows (a larger batch samples on the synchronous path)
MAX_DEVICE_REFERENCE_ROWS = 8

# columns of the float parameter table
_T, _TOP_P, _MIN_P, _REP, _PRES, _FREQ = range(6)
# columns of the int parameter table
_TOP_K, _SEED = range(2)


# the reference `sample` (exact, no host sync): sample_device's answer for rows its plan may leave open
_REFERENCE = sampling.sample.backends["reference"]


@dataclass
class _Step:
    """One step's rows: uploaded indices, gathered parameters and the penalty rows."""
    idx: torch.Tensor  # [2 or 3, B] int64 on the device: rows, steps (, master slots)
    row_t: torch.Tensor  # idx[0]
    step_t: torch.Tensor  # idx[1]
    fp: torch.Tensor  # [6, B] float parameters
    ip: torch.Tensor  # [2, B] int parameters
    rows_np: np.ndarray  # the rows on the host
    pen_sel: slice | torch.Tensor | None  # the batch rows with penalties (a slice: all); None: none


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
        self._last_plan = None  # (rows, vocab, max_finite) -> the plan made for them (_plan)

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
        self._last_plan = None  # the row's parameters change
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
    def _gather(self, rows: list[int], steps: list[int], slots: list[int] | None = None) -> _Step:
        """Upload the step's rows and steps (and master slots) in one copy; gather their parameters."""
        B = len(rows)
        host = np.empty((3 if slots is not None else 2, B), dtype=np.int64)
        host[0] = rows
        host[1] = steps
        if slots is not None:
            host[2] = slots
        idx = torch.from_numpy(host)
        if self.device.type != "cpu":
            idx = idx.to(self.device, non_blocking=True)
        row_t = idx[0]
        rows_np = host[0]
        pen = self._uses_penalty[rows_np]
        pen_sel = None
        if pen.any():
            b_idx = np.nonzero(pen)[0]
            pen_sel = slice(None) if len(b_idx) == B else torch.from_numpy(b_idx).to(self.device, non_blocking=True)
        return _Step(idx, row_t, idx[1], self.fparams[:, row_t], self.iparams[:, row_t], rows_np, pen_sel)

    def _penalize(self, logits: torch.Tensor, st: _Step, col_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The logits with the penalty rows' repetition / presence / frequency penalties (float32);
        col_ids: the tokens of the logits' columns (the masks and counts are read there)."""
        sel = st.pen_sel
        if sel is None:
            return logits
        logits = logits.float()
        pr = st.row_t[sel]
        fp = st.fp
        mask, counts = self.prompt_mask[pr], self.output_counts[pr]
        if col_ids is not None:
            at = col_ids[sel].clamp_min(0)
            mask, counts = mask.gather(1, at), counts.gather(1, at)
        out = ops.apply_penalties(logits[sel], mask, counts, fp[_REP][sel], fp[_PRES][sel], fp[_FREQ][sel])
        if isinstance(sel, slice):
            return out
        logits[sel] = out
        return logits

    def _count(self, st: _Step, tokens: torch.Tensor) -> None:
        """Add the step's tokens to the penalty rows' output counts (on the device)."""
        sel = st.pen_sel
        if sel is None:
            return
        pr, pt = st.row_t[sel], tokens[sel]
        self.output_counts.index_put_((pr, pt), torch.ones(pr.shape[0], dtype=torch.int32, device=self.device),
                                      accumulate=True)

    def _sample_args(self, logits: torch.Tensor, st: _Step) -> tuple:
        fp, ip = st.fp, st.ip
        return (logits, fp[_T], ip[_TOP_K], fp[_TOP_P], fp[_MIN_P], ip[_SEED], st.step_t)

    def _planned_backend(self) -> str | None:
        """The selected `sample` backend when the Sampler runs it as its own plan (no host sync),
        else None (the op itself runs)."""
        backend = ops.sample.selected(self.device.type)
        if backend in sampling.PLANNED_BACKENDS and not knobs.value("MSTAR_VERIFY"):
            return backend
        return None

    @staticmethod
    def _columns_to_ids(tokens: torch.Tensor, col_ids: torch.Tensor | None) -> torch.Tensor:
        return tokens if col_ids is None else col_ids.gather(1, tokens.unsqueeze(1)).squeeze(1)

    def _plan(self, rows_np: np.ndarray, V: int, max_finite: int | None = None) -> sampling.SamplePlan:
        """The step's plan; the last one is kept (overlapped decode asks on_device, then
        sample_device, for the same rows), until a row's parameters change."""
        key = (rows_np.tobytes(), V, max_finite)
        if self._last_plan is not None and self._last_plan[0] == key:
            return self._last_plan[1]
        plan = sampling.make_plan(self._fhost[0, rows_np], self._top_k[rows_np], self._fhost[1, rows_np],
                                  self._fhost[2, rows_np], V, max_finite=max_finite)
        self._last_plan = (key, plan)
        return plan

    def sample(self, logits: torch.Tensor, rows: list[int], steps: list[int],
               masked: list[tuple[int, list[int]]] | None = None, slots: list[int] | None = None,
               max_finite: int | None = None, col_ids: torch.Tensor | None = None) -> SampleResult:
        """Sample one token for each row of `logits` [B, V].

        rows[b]: the sampler row of logits row b; steps[b]: the index of the output token
        drawn (= tokens generated so far); masked: (b, ids) pairs whose ids must not be drawn;
        slots[b]: the decode master slot of row b (only with `masters` set: the token is
        written there on the device); col_ids: the token of each column (module docstring).
        """
        B = logits.shape[0]
        V = logits.shape[1]
        scatter = self.masters is not None and slots is not None
        st = self._gather(rows, steps, slots if scatter else None)
        if col_ids is not None and (masked or (self._num_logprobs[st.rows_np] >= 0).any()):
            raise ValueError("Sampler.sample: candidate columns take no masked ids and no logprobs")
        logits = self._penalize(logits, st, col_ids)
        if masked:
            # logits is this step's own tensor (compute_logits output): written in place
            ti = [t for _, ids in masked for t in ids if t < V]
            bi = [b for b, ids in masked for t in ids if t < V]
            if ti:
                m = torch.tensor([bi, ti], dtype=torch.int64).to(self.device, non_blocking=True)
                logits[m[0], m[1]] = float("-inf")

        rows_np = st.rows_np
        nlp = self._num_logprobs[rows_np]
        n_top = int(nlp.max()) if B else -1
        plan = None
        greedy = self._greedy[rows_np].all()
        if greedy and n_top < 0:  # argmax only: no softmax over the vocabulary
            tokens, tok_lp, top_ids, top_lp = logits.argmax(dim=-1), None, None, None
        elif greedy:  # no sort over the vocabulary for an all-greedy batch
            tokens, tok_lp, top_ids, top_lp = ops.greedy_sample(logits, max(n_top, 0))
        else:
            args = self._sample_args(logits, st)
            backend = self._planned_backend()
            if col_ids is not None:
                plan = sampling.whole_row_plan(V, self._greedy[rows_np].any())
                out = sampling.sample_planned(*args, 0, plan, token_logprobs=False, col_ids=col_ids)
                tokens, tok_lp, top_ids, top_lp, _ = out
            elif backend is not None:
                plan = self._plan(rows_np, V, max_finite)
                out = sampling.sample_planned(*args, max(n_top, 0), plan, sampling.PLANNED_BACKENDS[backend],
                                              token_logprobs=n_top >= 0)
                tokens, tok_lp, top_ids, top_lp, _ = out
            else:
                tokens, tok_lp, top_ids, top_lp = ops.sample(*args, max(n_top, 0))
        tokens = self._columns_to_ids(tokens, col_ids)

        if plan is not None and not plan.complete:
            # the exact flags come back with the tokens, in the same copy
            tok_list, ok = torch.stack([tokens, out[4].to(torch.int64)]).tolist()
            bad = [b for b in range(B) if not ok[b]]
            if bad:  # rare: rows the fast stages could not decide (extra syncs only here)
                for b, t in zip(bad, sampling.redo_rows(out, bad, *args).tolist()):
                    tok_list[b] = t
            if scatter:  # after redo_rows, which rewrites the redone rows of `tokens` in place
                self.masters.scatter_tokens(st.idx[2], tokens)
        else:
            if scatter:  # queued before the read-back
                self.masters.scatter_tokens(st.idx[2], tokens)
            tok_list = tokens.tolist()

        self._count(st, tokens)

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

    # --- the step on the device (overlapped decode) ------------------------------------------
    def on_device(self, rows: list[int], max_finite: int | None = None) -> bool:
        """Can `sample_device` draw these rows' tokens: no row asks for logprobs, and sampled rows
        only when the selected path needs no host sync (the Sampler's plan, or the reference op),
        and, when the plan is incomplete, at most MAX_DEVICE_REFERENCE_ROWS rows would take the
        reference's full-vocabulary sort as well (beyond that the sort costs more device time than
        the overlap hides host time: ~75 us a row of 152k ids on an H200)."""
        r = np.asarray(rows, dtype=np.int64)
        if (self._num_logprobs[r] >= 0).any():
            return False
        greedy = self._greedy[r]
        if greedy.all():
            return True
        if self._planned_backend() is None:
            return ops.sample.selected(self.device.type) == "reference"
        plan = self._plan(r, self.vocab_size, max_finite)
        if plan.complete:
            return True
        return int((~greedy).sum()) - len(plan.full_rows) - len(plan.ref_rows) <= MAX_DEVICE_REFERENCE_ROWS

    def all_plain_greedy(self, rows: list[int]) -> bool:
        """Every row is plain_greedy."""
        r = np.asarray(rows, dtype=np.int64)
        return bool(self._greedy[r].all() and not self._uses_penalty[r].any() and (self._num_logprobs[r] < 0).all())

    def sample_device(self, logits: torch.Tensor, rows: list[int], steps: list[int],
                      max_finite: int | None = None, col_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`sample`'s tokens for rows that `on_device` accepts, left on the device: [B] int64.

        Nothing is read back. Penalties apply and the output counts take the tokens as in
        `sample`. With the Sampler's plan, a complete plan is the whole draw; otherwise the rows a
        candidate stage decides keep its token and the others (known only on the device) take the
        reference's, computed for every row that went through a candidate stage: `sample`'s
        tokens wherever the planned stages decide (its redo takes a second candidate stage before
        the reference). Without the plan, the reference op (exact, no sync)."""
        V = logits.shape[1]
        st = self._gather(rows, steps)
        logits = self._penalize(logits, st, col_ids)
        rows_np = st.rows_np
        greedy = self._greedy[rows_np]
        if greedy.all():
            tokens = logits.argmax(dim=-1)
        else:
            args = self._sample_args(logits, st)
            backend = self._planned_backend()
            if col_ids is not None:
                plan = sampling.whole_row_plan(V, greedy.any())
                tokens = sampling.sample_planned(*args, 0, plan, token_logprobs=False, col_ids=col_ids)[0]
            elif backend is not None:
                plan = self._plan(rows_np, V, max_finite)
                tokens, _, _, _, exact = sampling.sample_planned(*args, 0, plan, sampling.PLANNED_BACKENDS[backend],
                                                                 token_logprobs=False)
                if not plan.complete:
                    cand = ~greedy
                    cand[list(plan.full_rows)] = False
                    cand[list(plan.ref_rows)] = False
                    c = np.nonzero(cand)[0]
                    if len(c):
                        r = slice(None) if len(c) == len(rows_np) else torch.from_numpy(c).to(self.device,
                                                                                             non_blocking=True)
                        ref = _REFERENCE.fn(*(a[r] for a in args), 0)[0]
                        tokens[r] = torch.where(exact[r], tokens[r], ref)
            else:
                tokens = ops.sample(*args, 0)[0]
        tokens = self._columns_to_ids(tokens, col_ids)
        self._count(st, tokens)
        return tokens
