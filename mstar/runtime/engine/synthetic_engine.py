"""A synthetic engine with the EngineCore API and no model: it isolates the server path
(engine process -> output transfer -> API process -> SSE -> clients) from the model.

    python -m mstar.runtime.serve --model qwen3.5-0.8b \\
        --engine-factory mstar.runtime.engine.synthetic_engine:SyntheticEngine --max-num-seqs 128

Every step emits one token for every running request (a request admitted in a step gets
its first token in that step, as a prefill would), paced at a fixed step rate: the step
sleeps until its slot, so the engine process spends CPU only on the bookkeeping and the
output transfer, the costs the server path adds. Token i of a request is
`synthetic_token(prompt, i, vocab)`, a function of the prompt, so a client can check that
every token arrived once and in order.

Settings come from the environment (inherited by the spawned engine process; not MSTAR_*
names, which the knob registry owns):
  SYNTH_STEPS_PER_S   step rate (default 200; 0: as fast as possible)
  SYNTH_VOCAB_SIZE    vocabulary (default: the preset's, else 248320)
  SYNTH_MAX_MODEL_LEN context limit (default: config.max_model_len or 4096)
  SYNTH_PREFILL_MS    extra time of a step that admits requests, as an eager prefill step
                      costs more than a graph-replayed decode step (default 0)

The vocabulary and eos ids follow the preset named by config.model when there is one; the
generated ids avoid the eos ids (so ignore_eos or not, a request runs to max_tokens unless a
stop_token_id is hit).
"""

from __future__ import annotations

import collections
import os
import time

from mstar.runtime.engine.request import CoreOutput, EngineRequest, RequestError

_DEFAULT_VOCAB = 248320


def synthetic_token(prompt_ids, i: int, vocab_size: int) -> int:
    """The i-th generated id of a request (0-based), from its prompt; never the top 1% of the
    vocabulary (where the special tokens sit)."""
    hi = max(2, vocab_size - max(3, vocab_size // 100))
    seed = (int(prompt_ids[0]) * 31 + int(prompt_ids[-1]) * 7 + len(prompt_ids)) if len(prompt_ids) else 0
    return (seed + 7919 * i) % hi


class _Seq:
    __slots__ = ("max_tokens", "n_out", "n_prompt", "prompt", "rid", "stop_ids")

    def __init__(self, rid, prompt, max_tokens, stop_ids):
        self.rid, self.prompt, self.max_tokens, self.stop_ids = rid, prompt, max_tokens, stop_ids
        self.n_out = 0
        self.n_prompt = len(prompt)


class SyntheticEngine:
    def __init__(self, config):
        self.config = config
        vocab, eos = _DEFAULT_VOCAB, ()
        try:
            from mstar.models import presets
            p = presets.get(config.model)
            if p is not None and isinstance(getattr(p, "config", None), dict):
                vocab = int(p.config.get("vocab_size") or vocab)
                e = p.config.get("eos_token_id")
                eos = tuple(e) if isinstance(e, (list, tuple)) else ((e,) if isinstance(e, int) else ())
        except Exception:  # noqa: BLE001 -- defaults without a preset
            pass
        self.vocab_size = int(os.environ.get("SYNTH_VOCAB_SIZE") or vocab)
        self.eos_token_ids = tuple(t for t in eos if t < self.vocab_size)
        self.max_model_len = int(os.environ.get("SYNTH_MAX_MODEL_LEN") or config.max_model_len or 4096)
        rate = float(os.environ.get("SYNTH_STEPS_PER_S", "200"))
        self.period = 1.0 / rate if rate > 0 else 0.0
        self.prefill_s = float(os.environ.get("SYNTH_PREFILL_MS", "0")) / 1e3
        self.max_num_seqs = int(config.resolve_max_num_seqs())
        self.device = "cpu"
        self.model_name = f"synthetic:{config.model}"
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._running: dict[str, _Seq] = {}
        self._pending: list[CoreOutput] = []
        self._next_t = 0.0
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_prefill_tokens = 0
        self.step_busy_s = 0.0  # wall time in step() outside the pacing sleep

    # -- the EngineCore API ---------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        prompt = list(req.prompt_token_ids)
        if not prompt:
            raise RequestError("prompt", "the prompt is empty")
        if any(t < 0 or t >= self.vocab_size for t in prompt):
            raise RequestError("prompt", f"token ids must be in [0, {self.vocab_size})")
        if len(prompt) + req.params.max_tokens > self.max_model_len:
            raise RequestError("max_tokens", f"prompt ({len(prompt)}) + max_tokens ({req.params.max_tokens}) "
                                             f"exceeds the context length {self.max_model_len}")
        stop = set(req.params.stop_token_ids)
        if not req.params.ignore_eos:
            stop.update(req.eos_token_ids or self.eos_token_ids)
        self._waiting.append(_Seq(req.request_id, prompt, req.params.max_tokens, frozenset(stop)))

    def abort(self, request_ids) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            seq = self._running.pop(rid, None)
            if seq is None:
                for s in self._waiting:
                    if s.rid == rid:
                        seq = s
                        self._waiting.remove(s)
                        break
            if seq is not None:
                self._pending.append(CoreOutput(rid, [], None, finish_reason="abort", num_prompt_tokens=seq.n_prompt))

    def has_unfinished(self) -> bool:
        return bool(self._running) or bool(self._waiting) or bool(self._pending)

    def step(self) -> list[CoreOutput]:
        if self.period:
            now = time.perf_counter()
            if self._next_t > now:
                time.sleep(self._next_t - now)
                now = self._next_t
            self._next_t = max(self._next_t + self.period, now)  # no catch-up bursts after a stall
        t0 = time.perf_counter()
        outputs, self._pending = self._pending, []
        admitted = False
        while self._waiting and len(self._running) < self.max_num_seqs:
            s = self._waiting.popleft()
            self._running[s.rid] = s
            self.num_prefill_tokens += s.n_prompt
            admitted = True
        if admitted and self.prefill_s:
            time.sleep(self.prefill_s)
            self._next_t = max(self._next_t, time.perf_counter())
        if self._running:
            self.num_steps += 1
        vocab = self.vocab_size
        done = []
        n_tok = 0
        for s in self._running.values():
            tid = synthetic_token(s.prompt, s.n_out, vocab)
            s.n_out += 1
            n_tok += 1
            finish = stop = None
            if tid in s.stop_ids:
                finish, stop = "stop", tid
            elif s.n_out >= s.max_tokens:
                finish = "length"
            outputs.append(CoreOutput(s.rid, [tid], None, finish_reason=finish, stop_token_id=stop,
                                      num_prompt_tokens=s.n_prompt))
            if finish is not None:
                done.append(s.rid)
        for rid in done:
            del self._running[rid]
        self.num_generated_tokens += n_tok
        self.step_busy_s += time.perf_counter() - t0
        return outputs

    def stats(self) -> dict:
        return {"running": len(self._running), "waiting": len(self._waiting), "kv_pages_used": 0,
                "kv_pages_total": 1, "kv_pages_free": 1, "kv_usage": 0.0, "num_steps": self.num_steps,
                "num_generated_tokens": self.num_generated_tokens, "num_prefill_tokens": self.num_prefill_tokens,
                "max_model_len": self.max_model_len, "synthetic_step_busy_s": self.step_busy_s}
