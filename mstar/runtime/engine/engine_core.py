"""The engine core: requests in, one scheduler step at a time, CoreOutputs out.

    core = EngineCore(EngineConfig(model="tiny-qwen3.5"))
    core.add_request(EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=8)))
    while core.has_unfinished():
        for out in core.step(): ...

A step: schedule (decode rows, then prefill chunks under the token budget; admissions,
preemptions) -> build the ForwardContext -> model.forward -> logits of the rows that
sample -> Sampler -> per sequence: append the token, check eos / stop ids / max_tokens /
max_model_len -> commit to the cache manager (new full pages enter the prefix cache) ->
free what finished. The core never detokenizes: text and stop strings are the
OutputProcessor's job, which tells the caller which requests to abort.

Abort: `abort(ids)` frees everything at once (pages, slot, sampler row, queue entry) and
queues a CoreOutput(finish_reason="abort"); it is returned by the next `step()` call
(`has_unfinished()` stays True until it has been returned). Unknown or finished ids are
ignored.

In-graph decode inputs (MSTAR_INGRAPH_DECODE_TOKENS / _ROPE, read once here at build;
decode_masters.py): a request takes a master slot when it is admitted (with its sampler row)
and gives it back when it finishes, is aborted or preempted (`_release_row`); the admission
writes its newest token (and position) from the host, the sampler scatters each sampled
token on the device, and with ROPE the host rewrites the position of every row an eager step
sampled for (graph steps advance it on the device).

Not thread-safe: one thread drives add_request / abort / step (the server's engine loop).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Iterable
from dataclasses import fields

import torch

from mstar import knobs
from mstar.ops import attention as ops_attention
from mstar.ops.cache import jit_watch
from mstar.models.context import dtype_name
from mstar.runtime.caches.cache_manager import CacheManager
from mstar.runtime.engine.config import EngineConfig, size_caches
from mstar.models import registry
from mstar.models.interfaces import EngineHooks, WarmupRequest
from mstar.runtime.engine.token_masks import TokenMasks
from mstar.runtime.engine.phase_timing import from_knobs as _phase_timer
from mstar.runtime.engine.request import CoreOutput, EngineRequest, RequestError, SamplingParams
from mstar.runtime.engine.sampler import Sampler
from mstar.runtime.scheduling.scheduler import PrefillRow, Scheduler, Sequence
from mstar.runtime.engine.step_inputs import StepInputBuilder, StepRows
from mstar.runtime.parallel.tp_group import release_graphs

log = logging.getLogger("mstar.runtime")


class EngineCore:
    def __init__(self, config: EngineConfig, *, model=None, tokenizer=None):
        """Load the model and tokenizer named by config.model (or take the given ones:
        tests), size and allocate the caches, bind them."""
        self.config = config
        t_start = time.perf_counter()
        # in-graph decode inputs: read once, here (decode_masters.py)
        ingraph_tokens = bool(knobs.value("MSTAR_INGRAPH_DECODE_TOKENS"))
        ingraph_rope = bool(knobs.value("MSTAR_INGRAPH_DECODE_ROPE"))
        if ingraph_rope and not ingraph_tokens:
            raise knobs.KnobError("MSTAR_INGRAPH_DECODE_ROPE=1 needs MSTAR_INGRAPH_DECODE_TOKENS=1 (the in-graph "
                                  "positions are kept per decode master slot); set both, or neither")
        self.device = config.resolve_device()
        config.resolve_max_num_seqs()
        self.dtype = config.resolve_dtype(self.device)
        # Triton kernel variants built from here on are counted; after the warm-up, each is logged
        self.jit_watch = jit_watch.install() if self.device.type == "cuda" else None
        if self.jit_watch is not None:
            self.jit_watch.mark_ready(False)
            jit0 = self.jit_watch.summary()
        self.tp = None  # tensor parallel (tp.py): followers, plan broadcast; None when tp = 1
        if config.tp > 1:
            if model is not None:
                raise ValueError("tp: a tensor-parallel engine loads its model itself (model= is tp=1 only)")
            from mstar.runtime.parallel.tp import TensorParallel
            self.tp = TensorParallel(config, self.device)
            model = self.tp.load_model(config, self.dtype)
        if model is None:
            from mstar.models import load_model
            model = load_model(config.model, dtype=self.dtype, device=self.device,
                               random_weights=config.random_weights, seed=config.seed)
        self.model = model
        t_loaded = time.perf_counter()
        if tokenizer is None:
            tokenizer = _try_tokenizer(config.model)
        self.tokenizer = tokenizer

        mcfg = model.config
        self.vocab_size = int(mcfg.vocab_size)
        self.eos_token_ids: tuple[int, ...] = tuple(int(t) for t in (model.eos_token_ids or ()))
        max_len = config.resolve_max_model_len(getattr(mcfg, "max_position_embeddings", None))

        spec = model.cache_spec()
        attention_building = False  # a paged-attention backend compiles its kernels in the background
        for head_dim in sorted({a.head_dim for a in spec.attention}):
            # a backend compiling its kernels on first use starts now, beside the rest of the start-up
            attention_building |= ops_attention.prepare_paged_attention(self.device, head_dim=head_dim,
                                                                         dtype=self.dtype)
        # decode-only steps replay CUDA graphs (cuda_graphs.py) on CUDA, or their buffers in "static"
        wants_graphs = config.decode_graphs == "static" or (config.decode_graphs == "auto"
                                                            and self.device.type == "cuda")
        sizes = size_caches(config if self.tp is None else self.tp.sizing_config(config), spec, self.dtype,
                            self.device, max_len)
        if spec.attention:
            # one sequence must always fit in the pool on its own
            max_len = min(max_len, sizes.num_pages * sizes.page_size)
        self.max_model_len = max_len
        self.cache_sizes = sizes
        make_cm = CacheManager if self.tp is None else self.tp.cache_manager  # tp: logs cache ops for followers
        self.cm = make_cm(spec, num_pages=sizes.num_pages, page_size=sizes.page_size,
                          num_slots=sizes.num_slots, dtype=self.dtype, device=self.device,
                          enable_prefix_cache=config.enable_prefix_caching,
                          num_snapshot_slots=sizes.num_snapshot_slots if spec.state else 0,
                          num_cross_slots=sizes.num_cross_slots, padding=wants_graphs)
        model.bind_caches(self.cm.caches)
        if self.tp is not None:
            self.tp.attach(model)  # followers allocate the same caches
        # what a step calls: the model's forward (tp: wrapped by attach), or its compiled version
        # ("decode": only the forward the decode graphs capture, which sees one input shape per batch size)
        self.forward = self._graph_forward = model.forward
        if config.compile in ("on", "decode") and self.tp is None:
            from mstar.runtime.engine.compiled_forward import CompiledForward
            self._graph_forward = CompiledForward(model)
            if config.compile == "on":
                self.forward = self._graph_forward
        self.page_size = sizes.page_size
        self.has_state = bool(spec.state)
        self.has_attention = bool(spec.attention)
        self.sampler = Sampler(config.max_num_seqs, self.vocab_size, self.device)
        # what the model's family adds (registry.py): an admission stage (an encoder filling the
        # request's cross slot), default suppression lists, warm-up requests
        self.family = _family_of(config.model, mcfg)
        self.model_name = str(config.model)
        self.capabilities = self.family.capabilities if self.family is not None else frozenset()
        make_hooks = getattr(self.family, "engine_hooks", None)
        self.hooks: EngineHooks = (make_hooks(model, config) if make_hooks is not None else None) or EngineHooks()
        self.has_cross = spec.cross is not None
        self.admission = self.hooks.admission
        # media requests (speech): the family turns them into prompts and its output stage turns
        # their tokens into typed outputs (a streaming codec)
        self.output_stage = self.hooks.output_stage
        self.accepts = dict(self.hooks.accepts) if self.hooks.accepts else None
        self._constrain = bool(self.hooks.constrains_logits)
        # the family's sampleable ids of media requests: the head computes only those (tp 1)
        self._logit_ids = self.hooks.logit_ids if self.tp is None else None
        self._max_allowed = self.hooks.max_allowed_tokens if self._constrain else None
        # media steps sample on the family's candidate columns (tp 1, a family that lists them)
        self._candidates = (bool(knobs.value("MSTAR_CANDIDATE_SAMPLING")) and self._logit_ids is not None
                            and type(self.hooks).candidate_ids is not EngineHooks.candidate_ids)
        self._num_media = 0  # live media sequences
        if self.has_cross and self.admission is None:
            raise ValueError(f"{type(model).__name__} has per-request cross slots but its family declares no "
                             "admission stage to fill them")
        self.token_masks = TokenMasks(config.max_num_seqs, self.vocab_size, self.device)
        sup, begin = self.hooks.suppress_defaults()
        self.default_suppress, self.default_begin_suppress = tuple(sup), tuple(begin)
        self.scheduler = Scheduler(self.cm, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.resolve_max_num_batched_tokens(self.device),
                                   preemption_mode=config.preemption_mode)
        make_inputs = StepInputBuilder if self.tp is None else self.tp.input_builder  # tp: sends the plan
        self.inputs = make_inputs(page_size=self.page_size, device=self.device,
                                  has_attention=self.has_attention, has_state=self.has_state,
                                  cross_source_len=spec.cross.max_source_len if self.has_cross else 0,
                                  cross_page_size=spec.cross.page_size if self.has_cross else 0)
        self.masters = self._decode_masters(config, model, wants_graphs, ingraph_tokens, ingraph_rope)
        t_caches = time.perf_counter()
        self._snapshots = self.has_state and config.enable_prefix_caching and sizes.num_snapshot_slots > 0
        self._snap_every_page = knobs.value("MSTAR_GDN_SNAPSHOTS") == "page"
        self._seqs: dict[str, Sequence] = {}
        self._num_begin_suppress = 0  # live sequences with a first-token suppression list
        self._pending: list[CoreOutput] = []
        self._seed_rng = random.Random(config.seed)
        self._arrivals = 0
        self.warm_up_steps = 0  # steps the start-up warm-up ran (_warm_up)
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_prefill_tokens = 0
        # admission: how requests enter steps (stats(); /metrics as mstar_engine_stat). A burst
        # admitted over several steps pays a whole prefill step more, and a prefill step's host
        # cost hardly depends on its token count (notes/gpu-2026-11-30-idle-gather.md)
        self._t_added: dict[str, float] = {}  # request id -> when it was added, until first admitted
        self.num_prefill_steps = self.num_admission_steps = self.num_admitted = 0
        self.admission_wait_s = 0.0  # summed over admitted requests: added -> first admitted
        # MSTAR_PHASE_TIMING: per-step phase times (phase_timing.py); None (the default) costs
        # one `is not None` test per phase boundary and no clock or sync
        self.phase_timer = _phase_timer(self.device, {"model": str(config.model)})
        # until captured, steps run eagerly; overlapped decode (decode_overlap.py) needs the graphs
        self.graphs = self.prefill_graphs = self.overlap = None
        warm_up = config.warmup == "on" or (config.warmup == "auto" and self.device.type == "cuda")
        t_early = 0.0
        if warm_up and attention_building and self.tp is None:
            t_early = self._warm_up_beside_attention_build()
        t_graphs0 = time.perf_counter()
        self.graphs = self._capture_graphs(config, sizes, max_len) if wants_graphs else None  # None: eager
        self.prefill_graphs = self._prefill_graphs(config)  # None: prefill and mixed steps run the forward
        t_graphs = time.perf_counter()
        if self.graphs is None:
            self.masters = None  # nothing reads them
        self.sampler.masters = self.masters
        # admission batching: with graphs, few large eager prefill steps beat many small ones
        admit = config.admit_min_free
        if admit is None:
            admit = config.max_num_seqs // 4 if self.graphs is not None else 0
        self.scheduler.admit_min_free = admit
        self.scheduler.admit_max_wait = config.admit_max_wait
        overlap = config.async_output == "on" or (config.async_output == "auto" and config.decode_graphs == "auto")
        if overlap and self.graphs is not None:  # tp > 1: the loop-back is broadcast (tp.send_chained_step)
            if self.phase_timer is not None:
                log.warning("MSTAR_PHASE_TIMING synchronizes every step: overlapped decode (async_output) is off")
            else:
                from mstar.runtime.graphs.decode_overlap import DecodeOverlap
                self.overlap = DecodeOverlap(self)
        t_warm = time.perf_counter()
        if warm_up:
            self._warm_up()
        t_warm = time.perf_counter() - t_warm + t_early
        if self.jit_watch is not None:
            self.jit_watch.mark_ready()
            jit1 = self.jit_watch.summary()
            slow = ", ".join(f"{k.rsplit('.', 1)[-1]} {c} x {t:.1f} s"
                             for k, c, t in self.jit_watch.slowest(jit0["built"]) if t >= 0.5)
            log.info("start-up built %d Triton kernel variants (%.1f s of compiles and cache loads)%s",
                     jit1["built"] - jit0["built"], jit1["seconds"] - jit0["seconds"],
                     f"; slowest: {slow}" if slow else "")
        log.info("engine: %s on %s/%s, %d pages x %d tokens, %d slots + %d snapshots, max_model_len %d",
                 config.model, self.device, dtype_name(self.dtype), sizes.num_pages,
                 sizes.page_size, sizes.num_slots, sizes.num_snapshot_slots if spec.state else 0, max_len)
        log.info("engine start-up %.1f s: model %.1f s, tokenizer + caches %.1f s, graphs %.1f s, "
                 "warm-up %.1f s", time.perf_counter() - t_start, t_loaded - t_start, t_caches - t_loaded,
                 t_graphs - t_graphs0, t_warm)
        if self.tp is not None:
            self.tp.startup_done()  # tp > 1: ends the start-up timing (tp.py logs it)

    def _prefill_graphs(self, config: EngineConfig):
        mode = config.prefill_graphs
        if mode == "off":
            return None
        if mode in ("auto", "on") and self.device.type != "cuda":
            if mode == "on":
                log.warning("prefill graphs are off: they capture CUDA graphs, and the device is %s", self.device)
            return None
        if mode == "auto" and self.tp is not None:
            log.info("prefill graphs are off at tp > 1 unless asked for (--prefill-graphs on)")
            return None
        from mstar.runtime.graphs.prefill_graphs import PrefillGraphRunner, supported
        why = supported(self.model)
        if why is None and config.compile == "on":
            why = "the forward is compiled (--compile on)"
        if why is not None:
            (log.info if mode == "auto" else log.warning)("prefill graphs are off: %s", why)
            return None
        capture = mode != "static"
        if self.tp is not None:
            self.tp.start_prefill_graphs(capture=capture)
        return PrefillGraphRunner(self.model, device=self.device, dtype=self.dtype,
                                  max_tokens=config.resolve_max_num_batched_tokens(self.device),
                                  capture=capture, stream=getattr(self.graphs, "stream", None))

    def _warm_up(self) -> None:
        """Short requests run to their end at start-up, then every trace of them removed: their
        prefix-cache entries, the counters, the seed sequence of requests without a seed. Later
        requests get the tokens they would get without it. Two rounds: one row of a few pages,
        then three rows in one step whose token count is no multiple of 16. Kernels that compile
        a variant per shape class (Triton specializes integers on == 1 and % 16; FlashInfer and
        fla per batch layout) then meet those classes here rather than in a served request.
        A family may give its own rounds (EngineHooks.warmup_rounds: Whisper transcribes one
        second of silence)."""
        rounds = self.hooks.warmup_rounds(self.vocab_size, self.max_model_len, self.page_size)
        if rounds is None:
            cap = max(1, self.max_model_len - 4)
            ps = self.page_size
            rounds = [[min(4 * ps, cap)], [min(2 * ps + 3, cap), min(ps + 5, cap), min(7, cap)]]
            rounds = [[WarmupRequest([i % self.vocab_size for i in range(n)]) for n in r] for r in rounds]
        timer, self.phase_timer = self.phase_timer, None  # not a step of the engine's life
        try:
            for r, reqs in enumerate(rounds):
                for i, w in enumerate(reqs):
                    self.add_request(EngineRequest(f"mstar-warm-up-{r}-{i}", w.prompt_ids,
                                                   SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                                                   encoder_input=w.encoder_input))
                while self.has_unfinished():
                    self.step()
        except RequestError as e:  # a pool too small for it (tests): start cold rather than not at all
            log.warning("start-up warm-up skipped: %s", e)
            self.abort(list(self._seqs))  # a round admitted in part
            self._pending.clear()
        finally:
            self.phase_timer = timer
            self.warm_up_steps = self.num_steps
            self.reset_prefix_cache()
            self._seed_rng = random.Random(self.config.seed)
            self._arrivals = 0
            self.num_steps = self.num_generated_tokens = self.num_prefill_tokens = 0
            self.num_prefill_steps = self.num_admission_steps = self.num_admitted = 0
            self.admission_wait_s = 0.0
            if self.overlap is not None:
                self.overlap.num_chained = 0

    def _warm_up_beside_attention_build(self) -> float:
        """A cold start: the paged-attention backend builds its kernels in the background (FlashInfer's
        JIT, tens of seconds), and the decode graphs cannot be captured before it is done. Meanwhile
        the warm-up runs eagerly with paged attention on the reference, so that the step's other
        kernels (Triton's variants, tens of seconds more) compile beside that build rather than
        after it. The warm-up after the capture then finds them built. Its seconds."""
        t0 = time.perf_counter()
        masters, self.masters = self.masters, None  # in-graph inputs: nothing captured reads them yet
        try:
            with ops_attention.paged_attention_on_reference():
                self._warm_up()
        finally:
            self.masters = masters
        t = time.perf_counter() - t0
        log.info("warm-up beside the attention kernels' build: %.1f s (paged attention on the reference; "
                 "the build %s)", t, "still running" if ops_attention.paged_attention_building() else "done")
        return t

    def _decode_masters(self, config: EngineConfig, model, wants_graphs: bool, tokens: bool, rope: bool):
        """The master buffers of in-graph decode inputs (allocated before any capture), or None."""
        if not tokens:
            return None
        why = None
        if not getattr(model, "reads_device_loopback", False):
            why = f"{type(model).__name__} reads its decode inputs on the host"
        elif not wants_graphs:
            why = "decode graphs are off"
        elif self.tp is not None:
            why = "tensor parallel (followers stage their own inputs)"
        if why is not None:
            log.warning("MSTAR_INGRAPH_DECODE_TOKENS has no effect: %s", why)
            return None
        from mstar.runtime.graphs.decode_masters import DecodeMasters
        return DecodeMasters(config.max_num_seqs, self.device, positions=rope)

    def _capture_graphs(self, config: EngineConfig, sizes, max_len: int):
        from mstar.runtime.graphs.cuda_graphs import DecodeGraphRunner
        params = dict(page_size=sizes.page_size, max_batch=min(config.max_graph_batch, config.max_num_seqs),
                      num_pages=sizes.num_pages, max_model_len=max_len, pad_page=self.cm.pad_page,
                      pad_slot=self.cm.pad_slot, capture=config.decode_graphs == "auto", pad_cross=self.cm.pad_cross,
                      cross_source_len=self.cm.spec.cross.max_source_len if self.has_cross else 0,
                      cross_page_size=self.cm.spec.cross.page_size if self.has_cross else 0)
        runner = DecodeGraphRunner(self.model, self._graph_forward, device=self.device, masters=self.masters,
                                   **params)
        if self.tp is not None:  # every rank captures the same graphs at once (no eager fallback)
            self.tp.start_graphs(params)
            runner.capture()
            return runner
        try:
            runner.capture()
        except Exception as e:  # noqa: BLE001 -- a backend that cannot be captured: decode eagerly
            log.warning("decode graphs: capture failed (%s: %s); decode steps run eagerly", type(e).__name__, e)
            torch.cuda.synchronize(self.device)
            return None
        return runner

    # ======================================================================================
    # requests
    # ======================================================================================
    def add_request(self, req: EngineRequest) -> None:
        """Queue a request; RequestError (naming the field) when it cannot be served."""
        rid = req.request_id
        if not isinstance(rid, str) or not rid:
            raise RequestError("request_id", "must be a non-empty string")
        if rid in self._seqs:
            raise RequestError("request_id", f"duplicate request id {rid!r}")
        media = getattr(req, "media", None)
        if media is not None:
            if self.output_stage is None:
                raise RequestError("model", f"{self.model_name} takes token prompts, not media requests")
            try:
                prompt_ids, fields = self.hooks.media_request(media)
                params = SamplingParams(**fields)
            except (TypeError, ValueError) as e:  # "field: message" names the field
                field, sep, message = str(e).partition(": ")
                raise (RequestError(field, message) if sep and field.isidentifier()
                       else RequestError("input", str(e))) from None
            req = dataclasses.replace(req, prompt_token_ids=list(prompt_ids), params=params, media=None)
        params = req.params if req.params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError("params", "must be SamplingParams")
        params.validate()
        try:
            prompt = [int(t) for t in req.prompt_token_ids]
        except (TypeError, ValueError):
            raise RequestError("prompt", "token ids must be integers") from None
        n = len(prompt)
        if n == 0:
            raise RequestError("prompt", "empty prompt")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise RequestError("prompt", f"token ids must be in [0, {self.vocab_size})")
        if n >= self.max_model_len:
            raise RequestError("prompt", f"prompt has {n} tokens; the context is {self.max_model_len} "
                               "tokens and at least one must be left to generate")
        if n + params.max_tokens > self.max_model_len:
            raise RequestError("max_tokens", f"prompt ({n}) + max_tokens ({params.max_tokens}) exceeds "
                               f"the context length {self.max_model_len}")
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise RequestError("stop_token_ids", f"ids must be in [0, {self.vocab_size})")
        enc_in = getattr(req, "encoder_input", None)
        if self.admission is not None:
            if enc_in is None:
                raise RequestError("encoder_input", "this model needs the encoder input of the request (audio)")
            bad = self.admission.check(enc_in)
            if bad:
                raise RequestError("encoder_input", bad)
        elif enc_in is not None:
            raise RequestError("encoder_input", "this model takes no encoder input")
        sup = getattr(req, "suppress_token_ids", None)
        begin = getattr(req, "begin_suppress_token_ids", None)
        sup = self.default_suppress if sup is None else tuple(int(t) for t in sup)
        begin = self.default_begin_suppress if begin is None else tuple(int(t) for t in begin)
        eos = tuple(req.eos_token_ids) or self.eos_token_ids
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(eos)
        if any(t < 0 or t >= self.vocab_size for t in (*sup, *begin)):
            raise RequestError("suppress_token_ids", f"ids must be in [0, {self.vocab_size})")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        try:  # the sampler's row, built now: a value its tables cannot hold fails this request, not a step
            values = self.sampler.row_values(params, int(seed))
        except (OverflowError, RuntimeError, TypeError, ValueError) as e:
            raise RequestError("params", f"cannot be represented: {e}") from None
        self._arrivals += 1
        seq = Sequence(request_id=rid, token_ids=prompt, num_prompt_tokens=n, params=params,
                       stop_ids=frozenset(stop), seed=int(seed), max_len=self.max_model_len,
                       arrival=self._arrivals, encoder_input=enc_in, suppress_ids=sup, begin_suppress_ids=begin,
                       sampler_values=values, media=media is not None)
        if media is not None:
            self.output_stage.add(rid, media)
            self._num_media += 1
        self._seqs[rid] = seq
        self._num_begin_suppress += bool(begin)
        self._t_added[rid] = time.monotonic()
        self.scheduler.add(seq)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Free everything the requests hold now; their CoreOutput(finish_reason="abort")
        comes with the next step()."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            seq = self._seqs.pop(rid, None)
            if seq is None:
                continue
            self._drop(seq)
            self._pending.append(CoreOutput(rid, [], None, finish_reason="abort",
                                            num_prompt_tokens=seq.num_prompt_tokens,
                                            num_cached_tokens=seq.num_cached_tokens))

    def _drop(self, seq: Sequence) -> None:
        self._num_begin_suppress -= bool(seq.begin_suppress_ids)
        self._num_media -= seq.media  # (the output stage lets the request go at its finishing output)
        self._t_added.pop(seq.request_id, None)  # aborted before its admission
        self.scheduler.remove(seq)
        self._release_row(seq)

    def _release_row(self, seq: Sequence) -> None:
        self.token_masks.clear(seq.sampler_row)
        self.sampler.release(seq.sampler_row)
        seq.sampler_row = -1
        if self.masters is not None:
            self.masters.release(seq.request_id)

    def has_unfinished(self) -> bool:
        return bool(self._seqs) or bool(self._pending)

    def has_running(self) -> bool:
        """An admitted sequence, a step in flight or outputs to emit: the next step cannot wait
        (engine_process.py gathers arrivals only when this is False)."""
        ov = self.overlap
        return bool(self.scheduler.running) or bool(self._pending) or (ov is not None and ov.inflight is not None)

    def num_unfinished(self) -> int:
        return len(self._seqs)

    # ======================================================================================
    # the step
    # ======================================================================================
    @torch.inference_mode()
    def step(self) -> list[CoreOutput]:
        outputs = self._step()
        if self.output_stage is not None and outputs:
            self.output_stage.process(outputs)
        return outputs

    def _step(self) -> list[CoreOutput]:
        ov = self.overlap
        if ov is not None and ov.inflight is not None:
            if ov.can_chain():
                return self._chained_step()
            self._pending += ov.finish()  # read the step in flight back before anything else
        pt = self.phase_timer
        if pt is not None:
            pt.start()
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        for seq in sched.preempted:
            self._release_row(seq)
        for seq in sched.failed:  # cannot fit even alone (should not happen: add_request checks)
            log.error("request %s cannot fit in the cache even alone; finished", seq.request_id)
            self._seqs.pop(seq.request_id, None)
            self._drop(seq)
            outputs.append(CoreOutput(seq.request_id, [], None, finish_reason="abort",
                                      num_prompt_tokens=seq.num_prompt_tokens))
        masters = self.masters
        if masters is not None and sched.admitted:
            # a master slot each (MasterCapacityError past the capacity), holding the newest
            # token and its position: what a decode step of the row reads first (a reloaded
            # row decodes at once; a prefill's sampled token overwrites them)
            adm = sched.admitted
            masters.write([masters.assign(s.request_id) for s in adm], [s.token_ids[-1] for s in adm],
                          [len(s.token_ids) - 1 for s in adm])
        if sched.prefill:
            self.num_prefill_steps += 1
        first = [t for t in (self._t_added.pop(s.request_id, None) for s in sched.admitted) if t is not None]
        if first:
            self.num_admission_steps += 1
            self.num_admitted += len(first)
            self.admission_wait_s += len(first) * time.monotonic() - sum(first)
        for seq in sched.admitted:
            if seq.sampler_row < 0:
                seq.sampler_row = self.sampler.add(seq.params, seq.seed, seq.token_ids[:seq.num_prompt_tokens],
                                                   seq.output_ids, seq.sampler_values)
                if seq.suppress_ids:
                    self.token_masks.set(seq.sampler_row, seq.suppress_ids)
        if self.admission is not None and sched.admitted:
            # the admission stage, once per admission (again after a preemption), batched over the step
            self.admission.run([s.encoder_input for s in sched.admitted],
                               [self.cm.cross_slot(s.request_id) for s in sched.admitted])
        if sched.is_empty:
            return outputs
        self.num_steps += 1
        if pt is not None:
            pt.mark(1)

        rows = self._rows(sched.decode, sched.prefill)
        graphs = self.graphs
        d_slots = None  # in-graph inputs: the decode rows' master slots (a graph step)
        if graphs is not None and not sched.prefill and graphs.bucket(len(sched.decode)) is not None:
            if pt is not None:
                pt.before_forward()
            launch = ov is not None and ov.eligible(sched.decode)
            if self.tp is not None:  # (the followers mirror the launch's vocab-parallel argmax)
                self.tp.send_graph_step(rows, greedy=launch and ov.vocab_parallel_argmax())
            if masters is None:
                hidden = graphs.run(rows)  # the sampling rows, in order
            else:  # in-graph inputs: the rows' master slots instead of their tokens
                d_slots = masters.slots_of(sched.decode)
                hidden = graphs.run(rows, slots=d_slots)
            n_sample = hidden.shape[0]
            if launch:
                self._advance_decode(sched.decode, commit=True)
                ov.launch(sched.decode, hidden)  # its outputs come with the next step
                return outputs
        else:
            ctx, n_sample = self.inputs.build(rows)
            if pt is not None:
                pt.before_forward()
            pg = self.prefill_graphs
            if pg is not None and pg.fits(ctx.input_ids.shape[0]):
                hidden = pg.run(ctx)
            else:
                hidden = self.forward(ctx)
            if n_sample:
                hidden = hidden[ctx.logits_indices]
        if pt is not None:
            pt.after_forward()

        # sequences that sample this step, in logits order
        sampling: list[Sequence] = list(sched.decode)
        sampling += [r.seq for r in sched.prefill if r.samples]
        s_slots = None  # in-graph inputs: the sampling rows' master slots (the sampler writes their tokens)
        if masters is not None and n_sample:
            s_slots = d_slots if d_slots is not None else masters.slots_of(sampling)  # graph step: decode rows only
            if d_slots is None and masters.positions is not None:
                # an eager step: each sampling row's next decode position is its length now
                # (a graph step advances it on the device)
                masters.write(s_slots, positions=[len(s.token_ids) for s in sampling])
        result = None
        if n_sample:
            steps = [s.num_output_tokens for s in sampling]
            rows_s = [s.sampler_row for s in sampling]
            masked = [(b, list(s.stop_ids)) for b, s in enumerate(sampling)
                      if s.num_output_tokens < s.params.min_tokens and s.stop_ids]
            if self._num_begin_suppress:
                masked += [(b, list(s.begin_suppress_ids)) for b, s in enumerate(sampling)
                           if s.num_output_tokens == 0 and s.begin_suppress_ids]
            columns = not masked and not any(s.params.logprobs is not None for s in sampling)
            logits, mf, col_ids = self.sampling_logits(hidden, sampling, rows_s, steps, columns)
            if pt is not None:
                pt.mark(4, sync=True)
            result = self.sampler.sample(logits, rows_s, steps, masked, slots=s_slots, max_finite=mf,
                                         col_ids=col_ids)
            if pt is not None:
                pt.mark(5)
        elif pt is not None:
            pt.mark(4)
            pt.mark(5)

        # bookkeeping: computed lengths, prefix-cache commits
        cm = self.cm
        self._advance_decode(sched.decode, commit=True)
        for r in sched.prefill:
            r.seq.num_computed = r.end
            cm.commit(r.seq.request_id, r.seq.token_ids, r.end)
            self.num_prefill_tokens += r.end - r.start

        if result is not None:
            lps = result.logprobs
            for b, (seq, tok) in enumerate(zip(sampling, result.tokens)):
                seq.token_ids.append(tok)
                self.num_generated_tokens += 1
                out = self._token_output(seq, tok, None if lps is None else lps[b], seq.num_output_tokens)
                outputs.append(out)
                if out.finish_reason is not None:
                    self._seqs.pop(seq.request_id, None)
                    self._drop(seq)
        if pt is not None:
            pt.end(len(sched.decode), len(rows.prefill_tokens), len(sched.prefill), self.has_unfinished())
        return outputs

    def sampling_logits(self, hidden: torch.Tensor, seqs: list[Sequence], rows: list[int], steps: list[int],
                        columns: bool = True) -> tuple[torch.Tensor, int | None, torch.Tensor | None]:
        """The sampling rows' float32 logits, ready for the sampler (the synchronous and the
        overlapped step share this), the most finite logits a row can have (None: any), and the
        token of each column (None: column = token id): the head (over the family's logit_ids
        alone when every row is a media request of a family that declares them; on its
        candidate columns alone with MSTAR_CANDIDATE_SAMPLING, where `columns` allows: no
        masked ids, no logprobs), the static token masks, the family's constraint."""
        media_only = self._num_media > 0 and all(s.media for s in seqs)
        if columns and self._candidates and media_only and not self.token_masks.active:
            col_ids = self.hooks.candidate_ids([s.request_id for s in seqs], steps)
            if col_ids is not None:
                return self.model.compute_logits_at(hidden, self._logit_ids, col_ids), col_ids.shape[1], col_ids
        if self._logit_ids is not None and media_only:
            logits = self.model.compute_logits_of(hidden, self._logit_ids)
        else:
            logits = self.model.compute_logits(hidden)
        if self.token_masks.active:
            self.token_masks.apply(logits, rows)
        if self._constrain and self._num_media:
            self.hooks.constrain_logits(logits, [s.request_id if s.media else None for s in seqs], steps)
        return logits, (self._max_allowed if media_only else None), None

    def max_finite(self, seqs: list[Sequence]) -> int | None:
        """sampling_logits' bound on the finite logits of a row, for a step not yet computed."""
        return self._max_allowed if self._num_media > 0 and all(s.media for s in seqs) else None

    def _advance_decode(self, decode: list[Sequence], commit: bool) -> None:
        """The decode rows' new tokens are in the caches; commit: offer full pages to the
        prefix cache (their token ids must be known: not for a chained overlapped step)."""
        cm = self.cm
        for seq in decode:
            seq.num_computed += 1
            if commit:
                cm.commit(seq.request_id, seq.token_ids, seq.num_computed)

    def _token_output(self, seq: Sequence, tok: int, lp, n_out: int) -> CoreOutput:
        """The output of a sequence's n_out-th generated token, with its finish reason."""
        finish, stop_tok = None, None
        if tok in seq.stop_ids and n_out > seq.params.min_tokens:
            finish, stop_tok = "stop", tok
        elif n_out >= seq.params.max_tokens or seq.num_prompt_tokens + n_out >= seq.max_len:
            finish = "length"
        return CoreOutput(seq.request_id, [tok], None if lp is None else [lp], finish_reason=finish,
                          stop_token_id=stop_tok, num_prompt_tokens=seq.num_prompt_tokens,
                          num_cached_tokens=seq.num_cached_tokens)

    def _chained_step(self) -> list[CoreOutput]:
        """Overlapped decode: launch the in-flight rows' next step, then read the in-flight
        one back (decode_overlap.py); returns its outputs."""
        ov = self.overlap
        prev = ov.inflight
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if (sched.prefill or sched.admitted or sched.preempted or sched.failed
                or len(sched.decode) != len(prev.seqs) or any(a is not b for a, b in zip(sched.decode, prev.seqs))):
            raise RuntimeError("overlapped decode: the scheduler did not continue the in-flight rows "
                               f"({len(sched.decode)} decode, {len(sched.prefill)} prefill, "
                               f"{len(sched.admitted)} admitted, {len(sched.preempted)} preempted)")
        self.num_steps += 1
        rows = self._rows(sched.decode, [])
        masters = self.masters
        if masters is None:
            loop = prev.tokens
            if self.tp is not None:  # the plan, then the tokens broadcast to every rank's own buffer
                loop = self.tp.send_chained_step(rows, prev.tokens, greedy=ov.vocab_parallel_argmax())
            hidden = self.graphs.run(rows, loopback=loop)
        else:  # the launch of prev scattered its tokens into the masters the graph reads
            hidden = self.graphs.run(rows, slots=masters.slots_of(sched.decode))
        self._advance_decode(sched.decode, commit=False)  # committed once the input tokens are read back
        ov.launch(sched.decode, hidden)
        ov.num_chained += 1
        return outputs + ov.finish(prev)

    def _rows(self, decode: list[Sequence], prefill: list[PrefillRow]) -> StepRows:
        cm = self.cm
        attn, state = self.has_attention, self.has_state
        d_pages = [cm.pages(s.request_id) for s in decode] if attn else []
        p_pages = [cm.pages(r.seq.request_id) for r in prefill] if attn else []
        d_slots = [cm.slot(s.request_id) for s in decode] if state else []
        p_slots = [cm.slot(r.seq.request_id) for r in prefill] if state else []
        p_tokens: list[int] = []
        snapshots: list[tuple[int, int]] = []
        off = 0
        for r in prefill:
            toks = r.seq.token_ids
            p_tokens.extend(toks[r.start:r.end])
            if self._snapshots:
                for pos, slot in cm.snapshot_slots(r.seq.request_id, r.start, r.end, toks, self._snap_every_page):
                    snapshots.append((off + pos - r.start, slot))
            off += r.end - r.start
        return StepRows(
            decode_tokens=[s.token_ids[-1] for s in decode],
            decode_lens=[len(s.token_ids) for s in decode],
            decode_pages=d_pages, decode_slots=d_slots,
            prefill_tokens=p_tokens,
            prefill_starts=[r.start for r in prefill], prefill_ends=[r.end for r in prefill],
            prefill_pages=p_pages, prefill_slots=p_slots,
            prefill_samples=[r.samples for r in prefill],
            snapshots=snapshots,
            decode_cross=[cm.cross_slot(s.request_id) for s in decode] if self.has_cross else None,
            prefill_cross=[cm.cross_slot(r.seq.request_id) for r in prefill] if self.has_cross else None)

    # ======================================================================================
    # introspection
    # ======================================================================================
    def stats(self) -> dict:
        cs = self.cm.stats()
        d = {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_pages_used": cs.used_pages,
            "kv_pages_total": cs.total_pages,
            "kv_pages_free": cs.free_pages,
            "kv_pages_cached": cs.cached_pages,
            "kv_usage": cs.used_pages / cs.total_pages if cs.total_pages else 0.0,
            "state_slots_free": cs.free_slots,
            "state_slots_total": cs.total_slots,
            "prefix_hit_rate": cs.hit_rate,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "num_generated_tokens": self.num_generated_tokens,
            "num_prefill_tokens": self.num_prefill_tokens,
            "num_prefill_steps": self.num_prefill_steps,
            "num_admission_steps": self.num_admission_steps,  # steps that admitted a new request
            "num_admitted": self.num_admitted,
            "admission_wait_seconds": self.admission_wait_s,
            "max_model_len": self.max_model_len,
            "page_size": self.page_size,
        }
        if self.has_cross:
            d["cross_slots_total"] = cs.cross_slots_total
            d["cross_slots_free"] = cs.cross_slots_free
        if self.admission is not None:
            d.update(self.admission.stats())
        for f in fields(cs):
            if f.name.startswith(("prefix_", "snapshot_", "offloaded_", "cached_snapshots")):
                d[f.name] = getattr(cs, f.name)
        if self.device.type == "cuda":
            d["peak_gpu_mem_bytes"] = int(torch.cuda.max_memory_allocated(self.device))
        return d

    def cache_stats(self):
        return self.cm.stats()

    def reset_prefix_cache(self) -> None:
        self.cm.reset_prefix_cache()

    def close(self) -> None:
        """Release what outlives the object: tensor-parallel followers (no-op for tp = 1);
        write out the phase-timing records still buffered."""
        if self.phase_timer is not None:
            self.phase_timer.close()
        if self.tp is not None:
            release_graphs(self.graphs, self.prefill_graphs)  # before the group: NCCL waits for them
            self.tp.close()


def _try_tokenizer(name: str):
    try:
        from mstar.models import load_tokenizer
        return load_tokenizer(name)
    except Exception as e:  # noqa: BLE001 -- a checkpoint without tokenizer still serves token ids
        log.warning("no tokenizer for %s (%s); only token-id prompts will work", name, e)
        return None


def _family_of(name: str, config):
    """The registered family of the engine's model: by its name (preset or directory), else by
    its config's model_type (a model handed in by a test); None when neither is registered."""
    for look in (lambda: registry.family_of(name), lambda: registry.family_of_config(config)):
        try:
            return look()
        except (ValueError, FileNotFoundError):
            continue
    return None
