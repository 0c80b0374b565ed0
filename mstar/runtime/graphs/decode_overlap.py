"""Overlapped decode (EngineConfig.async_output): the host prepares and launches decode step
k while the device still runs step k-1, and reads step k-1's tokens only after step k is
queued. The sampled tokens stay on the device and feed the next step (device loop-back);
their host copy is asynchronous (pinned buffer + event).

Life of a decode step in this mode:
  launch   every row gets a placeholder as its newest token (its value is on the device),
           its computed length moves on, and the step's tokens start copying to the host;
  chain    the next step is launched before the previous one is read back when it is
           exactly "the same rows, one token further": nothing waits to be admitted (or
           admissions are held), every running row is in the batch, no row finishes by
           length, and the page pool has a page for every row. Its input ids are the
           previous step's tokens, copied on the device into the graph's token row
           ("loop-back"); with MSTAR_INGRAPH_DECODE_TOKENS the launch scatters the tokens into
           the decode masters instead (decode_masters.py), which the graph reads, and there
           is no loop-back copy. Tensor parallel (tp > 1): the tokens exist only on rank 0's
           device; its plan marks the step as chained and rank 0 broadcasts them to the
           followers' fixed buffers right before every rank's replay (tp.send_chained_step);
  finish   wait for the copy, write the tokens over the placeholders, commit the pages that
           are now fully known to the prefix cache, and produce the outputs: a step later
           than the synchronous path, the same tokens.
A row that stops on a stop token at step k-1 was already queued in step k: that step's
writes land in its pages and state slot, freed by then, before any later user of them
(one stream), and its token is dropped.

Which steps take this path (eligible): every decode row without logprobs and without pending
min_tokens masking, at tp = 1 whatever its sampling (temperature, top-k / top-p / min-p,
repetition / presence / frequency penalties; a sampled row only while the selected sampling
path has no host sync: Sampler.on_device) and also a media row of a family whose hooks
constrain the logits (Orpheus's per-frame-position mask). At tp > 1 only plain-greedy rows
outside such a family. Any other step runs synchronously after the read-back.

How the launch draws the tokens, all on the device, nothing read back:
  plain greedy  every row plain-greedy (no penalties) and none constrained: the argmax of the
                head's output (tp > 1: the vocab-parallel argmax, or the gathered logits' with
                static token masks), static token masks (Whisper's suppressed ids) applied;
  otherwise     the synchronous path's sampling: float32 logits (core.sampling_logits), static
                token masks, the family's constrain_logits, then Sampler.sample_device (the
                penalties, the draw, the penalty rows' output counts), with each row's step
                index its output count, placeholders included (the synchronous path's index for
                the same token). The tokens equal the synchronous path's (sampler.py says where
                its plan cannot decide a row).
The output counts take a token at its launch and nothing else does (finish only writes the
tokens back); a row that stopped while its next step was queued has that dropped token counted
too, in a row already released: a later request with penalties given the row clears its counts
first (queued after, on the same stream), and one without never reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mstar.runtime.engine.request import CoreOutput

PLACEHOLDER = -1  # a token whose value is still on the device


@dataclass
class _Inflight:
    seqs: list  # the step's decode rows, in row order
    tokens: torch.Tensor  # [D] int64 on the device (the loop-back source)
    host: torch.Tensor  # [D] int64, pinned: the asynchronous copy
    event: object  # torch.cuda.Event, or None on CPU
    positions: list[int]  # per row: index of its placeholder in token_ids


class DecodeOverlap:
    def __init__(self, core):
        self.core = core
        dev = core.device
        self._cuda = dev.type == "cuda"
        n = core.config.max_num_seqs
        self._host = [torch.zeros(n, dtype=torch.int64, pin_memory=self._cuda) for _ in range(2)]
        self._flip = 0
        self.inflight: _Inflight | None = None
        self.num_chained = 0  # steps launched before their predecessor was read back
        self._masters = core.masters  # in-graph decode inputs (None: loop-back copy)

    # --- which steps qualify -------------------------------------------------------------
    def eligible(self, seqs) -> bool:
        """Can the step's decode rows be launched with their tokens left on the device?"""
        core = self.core
        sampler = core.sampler
        # min_tokens not reached: the stop ids are masked before sampling (the synchronous path)
        if any(seq.num_output_tokens < seq.params.min_tokens and seq.stop_ids for seq in seqs):
            return False
        if core.tp is not None:
            # only the vocab-parallel argmax or the gathered logits' argmax: plain-greedy rows,
            # and no family constraint
            constrain = core._constrain
            return all(sampler.plain_greedy(seq.sampler_row) and not (constrain and seq.media) for seq in seqs)
        return sampler.on_device([seq.sampler_row for seq in seqs], core.max_finite(seqs))

    def can_chain(self) -> bool:
        """Would the scheduler's next step be the in-flight rows, one token further?"""
        fl = self.inflight
        core = self.core
        sch = core.scheduler
        if fl is None or core._pending:
            return False
        running = sch.running
        if len(running) != len(fl.seqs) or any(a is not b for a, b in zip(running, fl.seqs)):
            return False
        if sch.waiting and len(running) < sch.max_num_seqs and not sch.admission_held():
            return False  # the scheduler would admit (with no free row it cannot)
        if core.cm.num_free_pages < len(running):
            return False  # a row might need a page the pool does not have: no preemption here
        for seq in running:
            # the token in flight must not end the request by length, and the next one is drawn
            if seq.num_output_tokens >= seq.params.max_tokens or len(seq.token_ids) >= seq.max_len:
                return False
        return graphs_fit(core, len(running))

    def vocab_parallel_argmax(self) -> bool:
        """tp > 1 without per-request masks: the launch takes its tokens with the model's
        greedy_tokens (each rank's best of its vocab shard, one gather of (value, id) pairs; the
        logits are never gathered). The step's plan says so: the followers join that collective."""
        return self.core.tp is not None and not self.core.token_masks.active

    # --- launch / finish -----------------------------------------------------------------
    def launch(self, seqs, hidden: torch.Tensor) -> None:
        """Sample the step's rows on the device, start the host copy, leave placeholders."""
        core = self.core
        if self.vocab_parallel_argmax():
            tokens = core.model.greedy_tokens(hidden)
        else:
            rows = [seq.sampler_row for seq in seqs]
            constrain = core._constrain and core._num_media
            if core.tp is None and not (core.sampler.all_plain_greedy(rows)
                                        and not (constrain and any(seq.media for seq in seqs))):
                tokens = self._sample(seqs, rows, hidden)
            else:
                if core.tp is None:
                    # greedy: argmax of the head's output in the model dtype (its float32 copy, which
                    # compute_logits returns, orders the same values the same way)
                    logits = torch.nn.functional.linear(hidden, core.model.lm_head_weight())
                else:  # tp > 1 with masks: the vocab-parallel head's gather
                    logits = core.model.compute_logits(hidden)
                if core.token_masks.active:  # static per-request masks (Whisper's suppressed ids): on the device
                    core.token_masks.apply(logits, rows)
                tokens = logits.argmax(dim=-1)
        if self._masters is not None:
            # the rows' master slots are still the graph's staged row (this step's): on the device
            self._masters.scatter_tokens(core.graphs.row_slots(tokens.shape[0]), tokens)
        host = self._host[self._flip][:tokens.shape[0]]
        self._flip ^= 1
        host.copy_(tokens, non_blocking=self._cuda)
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
        positions = []
        for seq in seqs:
            positions.append(len(seq.token_ids))
            seq.token_ids.append(PLACEHOLDER)
        self.inflight = _Inflight(list(seqs), tokens, host, event, positions)

    def _sample(self, seqs, rows: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """The synchronous path's sampling of a step, left on the device: float32 logits, static
        token masks, the family's constraint, then Sampler.sample_device (penalties, the draw,
        the output counts). The step index of a row is its output count, placeholders included:
        what the synchronous path passes for the same token."""
        core = self.core
        steps = [seq.num_output_tokens for seq in seqs]
        logits, max_finite, col_ids = core.sampling_logits(hidden, seqs, rows, steps)  # (no masks, no logprobs here)
        return core.sampler.sample_device(logits, rows, steps, max_finite, col_ids)

    def finish(self, fl: _Inflight | None = None) -> list[CoreOutput]:
        """Read back a launched step (default: the one in flight): fill the placeholders,
        commit what is now known, outputs, finishes."""
        if fl is None:
            fl, self.inflight = self.inflight, None
        if fl is None:
            return []
        if fl.event is not None:
            fl.event.synchronize()
        core = self.core
        toks = fl.host.tolist()
        outputs = []
        for seq, pos, tok in zip(fl.seqs, fl.positions, toks):
            if core._seqs.get(seq.request_id) is not seq:
                continue  # aborted (or finished) meanwhile
            seq.token_ids[pos] = tok
            # the only other placeholder a row can hold is at pos + 1 (a chained step's): every
            # token below num_computed is known when num_computed <= pos + 1
            if seq.num_computed <= pos + 1:
                core.cm.commit(seq.request_id, seq.token_ids, seq.num_computed)
            core.num_generated_tokens += 1
            out = core._token_output(seq, tok, None, pos + 1 - seq.num_prompt_tokens)
            outputs.append(out)
            if out.finish_reason is not None:
                del seq.token_ids[pos + 1:]  # a chained step's placeholder, if any
                core._seqs.pop(seq.request_id, None)
                core._drop(seq)
        return outputs


def graphs_fit(core, n: int) -> bool:
    return core.graphs is not None and core.graphs.bucket(n) is not None
