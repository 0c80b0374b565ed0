"""`python -m mstar.runtime.serve`: the OpenAI-compatible server.

With no arguments it serves the embedded default model (a tiny random Qwen3.5 with the
built-in tokenizer) on http://127.0.0.1:8000, on the GPU when there is one and on CPU
otherwise. The engine runs in its own process (engine_process.py); this process runs
the HTTP front end, the tokenizer and the detokenizer (api_server.py).

    python -m mstar.runtime.serve                                   # tiny default, CPU or GPU
    python -m mstar.runtime.serve qwen3.5-0.8b --random-weights --port 8000    # or: mstar serve ...
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "Hello", "max_tokens": 16}'

SIGTERM (or Ctrl-C): stop accepting connections, let in-flight requests finish (up to
--drain-timeout seconds; what is still running then gets a 503 error body, or an error event
and [DONE] on a stream), stop the engine, exit 0. A second Ctrl-C forces the exit.

If the engine process dies, its requests fail at once with a 503 and a new engine is started
(--engine-restarts times, with back-off); once the restarts are spent the server exits with
code 1, so that a supervisor (systemd, Kubernetes) restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import logging
import os
import faulthandler
import signal
import socket
import sys
import time

logger = logging.getLogger("mstar.serve")

_WEB_STACK = ("fastapi", "uvicorn", "multipart")  # what the HTTP front end imports (python-multipart: forms)


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _positive_float(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {s}")
    return v


def _nonneg_int(s: str) -> int:
    v = int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def build_parser(prog: str = "python -m mstar.runtime.serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Serve a model over an OpenAI-compatible HTTP API: /v1/completions and /v1/chat/completions "
                    "(token generators), /v1/audio/transcriptions (Whisper), /v1/audio/speech (speech "
                    "synthesizers), /v1/images/generations and /v1/videos (image and video generators), and "
                    "/v1/models, /health, /metrics. With no arguments: the embedded tiny Qwen3.5 on "
                    "http://127.0.0.1:8000.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help="The model to serve, as --model (which names it the other way).")
    m = p.add_argument_group("model")
    m.add_argument("--model", default=None,
                   help="A model directory (HF layout: config.json, *.safetensors, tokenizer files; Kokoro's "
                        "release layout; Qwen3-TTS's release directory with its speech_tokenizer/; a diffusers "
                        "pipeline directory with model_index.json for Wan and Cosmos3) or a preset name (e.g. "
                        "tiny-qwen3.5, qwen3.5-0.8b, kokoro-82m, qwen3-tts-1.7b, wan2.2-ti2v-5b, cosmos3-edge); default: "
                        "tiny-qwen3.5. Presets without local weights need --random-weights (the tiny ones are "
                        "built in).")
    m.add_argument("--random-weights", action="store_true",
                   help="Initialise the weights randomly from the model's config instead of loading them "
                        "(benchmarks at the real shapes without a checkpoint).")
    m.add_argument("--codec", default=None, metavar="DIR|PRESET",
                   help="A speech LM's audio codec (Orpheus: a SNAC directory, config.json + weights as "
                        "published, or a SNAC preset such as snac-24khz). Default: a `snac` directory inside the "
                        "model's, else a snac* directory beside it; a preset's own codec preset.")
    m.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="The name(s) clients must use in the 'model' field; the first is reported in responses. "
                        "Default: the --model value.")
    m.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="Jinja chat template (a file, or the template text) replacing the tokenizer's own; "
                        "for checkpoints without one.")
    m.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="Weight and activation dtype; auto: bfloat16 on GPU, float32 on CPU.")
    m.add_argument("--device", default="auto",
                   help="auto (the GPU if there is one, else CPU), cpu, cuda or cuda:N.")
    m.add_argument("--tp", type=_positive_int, default=1,
                   help="Tensor-parallel degree: GPUs the model is split over (one process per GPU, NCCL; "
                        "gloo on CPU). Must divide the attention and GDN head counts.")
    m.add_argument("--seed", type=int, default=0,
                   help="Seed of the engine (random weights; requests without their own seed).")
    e = p.add_argument_group("engine")
    e.add_argument("--max-num-seqs", type=_positive_int, default=None,
                   help="Most sequences the engine runs in one step (decode batch size); default: 256 on CUDA, "
                        "64 on CPU.")
    e.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="Context length limit (prompt + output tokens); default: the model's, at most 4096.")
    e.add_argument("--page-size", type=_positive_int, default=None,
                   help="Tokens per KV-cache page (also the prefix-cache granule); default: MSTAR_PAGE_SIZE.")
    e.add_argument("--num-pages", type=_positive_int, default=None,
                   help="KV-cache pages in the pool; default: sized from free memory.")
    e.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                   help="Token budget of one step (prefill chunk size plus decodes); default: 8192 on CUDA, "
                        "2048 on CPU.")
    e.add_argument("--no-prefix-caching", action="store_true",
                   help="Disable reuse of cached prompt prefixes across requests.")
    e.add_argument("--decode-graphs", default="auto", choices=["auto", "off"],
                   help="auto: decode-only steps replay CUDA graphs captured at start-up (CUDA; every rank at --tp N); "
                        "off: every step runs eagerly.")
    e.add_argument("--prefill-graphs", default="auto", choices=["auto", "on", "off"],
                   help="on: prefill and mixed steps replay piecewise CUDA graphs (everything but the attention "
                        "and GDN cores, captured at padded token counts up to --max-num-batched-tokens; CUDA, every "
                        "rank at --tp N); auto: on at --tp 1 on CUDA (not yet measured at tp > 1); off: they run "
                        "the plain forward.")
    e.add_argument("--max-graph-batch", type=_positive_int, default=256,
                   help="Largest decode batch captured as a CUDA graph (capped by --max-num-seqs); larger "
                        "decode steps run eagerly.")
    e.add_argument("--admit-min-free", type=_nonneg_int, default=None,
                   help="While decodes run, admit new requests once this many can be admitted together (rows "
                        "free and requests waiting) or after --admit-max-wait held steps, so prefills run in few "
                        "large steps; "
                        "default: max-num-seqs / 4 with decode graphs, else 0 (admit at once). The batch waited "
                        "for is at most a quarter of the requests in the engine, so a burst at low concurrency "
                        "goes in at once.")
    e.add_argument("--admit-max-wait", type=_nonneg_int, default=16,
                   help="Most decode steps a request waiting for an admission batch (--admit-min-free) is held "
                        "before it is admitted anyway; 0: never held.")
    e.add_argument("--async-output", default="auto", choices=["auto", "on", "off"],
                   help="Overlapped decode: launch each graph-replayed decode step before the previous step's "
                        "tokens are read back (they feed the next step on the device). Greedy rows without "
                        "logprobs or penalties only; other steps run synchronously. auto: on where decode "
                        "graphs are captured (CUDA; at --tp N rank 0 broadcasts the looped-back tokens).")
    e.add_argument("--compile", default="auto", choices=["auto", "on", "decode", "off"],
                   help="torch.compile the model's forward so Inductor fuses the code between mstar's ops: "
                        "on (every step), decode (only inside the decode graphs), off; auto: off until it "
                        "measures faster.")
    e.add_argument("--warmup", default="auto", choices=["auto", "on", "off"],
                   help="Run short requests at start-up, before the server reports ready (one row, then three "
                        "rows of ragged lengths in one step), so that first-use kernel builds (FlashInfer's prefill "
                        "JIT, fla's autotuning, Triton's variants per shape class) do not land in served requests "
                        "(Whisper: one second of silence); it leaves no trace (prefix cache, counters, seeds). "
                        "auto: on CUDA.")
    e.add_argument("--engine-factory", default=None, metavar="MODULE:CALLABLE",
                   help="Advanced: build the engine with this callable(EngineConfig) instead of EngineCore "
                        "(it must offer the EngineCore API: add_request, abort, step, has_unfinished, stats).")
    e.add_argument("--startup-timeout", type=float, default=1800.0,
                   help="Seconds to wait for the engine to load the model before giving up.")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="Address to listen on (0.0.0.0: every interface).")
    s.add_argument("--port", type=_nonneg_int, default=8000,
                   help="TCP port to listen on (0: any free port; the URL is logged when ready).")
    s.add_argument("--api-key", default=None,
                   help="Require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize (401 otherwise); "
                        "/health and /metrics stay open (/health shows the engine's internals only with the key). "
                        "A key on the command line shows in the process list: prefer --api-key-file or "
                        "MSTAR_API_KEY. Off when none of the three is given.")
    s.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="Read the API key from this file (its first line).")
    s.add_argument("--max-pending", type=_positive_int, default=1024,
                   help="Overload limit: most sequences (prompts x n) admitted and not yet finished; beyond it "
                        "--overload-policy applies. A request of more sequences than this is a 400.")
    s.add_argument("--max-request-tokens", type=_positive_int, default=1 << 20,
                   help="Most prompt tokens in one request (all its prompts together); more is a 400, found "
                        "before the request is admitted.")
    s.add_argument("--overload-policy", default="reject", choices=["reject", "wait"],
                   help="Beyond --max-pending: reject answers 503 with a Retry-After header; wait holds the "
                        "request until there is room (or the client goes away).")
    s.add_argument("--max-video-jobs", type=_positive_int, default=32,
                   help="Video generators: most unfinished async jobs (POST /v1/videos, queued or running); "
                        "one more is a 503 with a Retry-After header.")
    s.add_argument("--max-body-bytes", type=_positive_int, default=32 * 1024 * 1024,
                   help="Largest request body accepted (bytes); larger ones get 413.")
    s.add_argument("--max-audio-seconds", type=float, default=1800.0,
                   help="Longest audio accepted by /v1/audio/transcriptions (Whisper models); longer is a 400.")
    s.add_argument("--drain-timeout", type=_positive_float, default=300.0,
                   help="On SIGTERM, seconds to let in-flight requests finish; then each gets a 503 (an error "
                        "event and [DONE] on a stream).")
    s.add_argument("--engine-restarts", type=_nonneg_int, default=3,
                   help="Engine processes started after one dies (1 s back-off, doubled each time); then the "
                        "server exits with code 1. 0: exit at the first death.")
    s.add_argument("--timeout-keep-alive", type=_positive_float, default=5.0,
                   help="Seconds an idle keep-alive connection stays open between requests.")
    s.add_argument("--timeout-header", type=_positive_float, default=10.0,
                   help="Seconds a connection may take to send a request's line and headers (slow or silent "
                        "clients are closed).")
    s.add_argument("--timeout-body", type=_positive_float, default=30.0,
                   help="Longest gap, in seconds, while a request body arrives (408 past it).")
    s.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"],
                   help="Log level (default: MSTAR_LOG_LEVEL, else info).")
    s.add_argument("--no-access-log", action="store_true", help="Do not log one line per HTTP request.")
    return p


DEFAULT_MODEL = "tiny-qwen3.5"


def parse_args(argv=None, prog: str = "python -m mstar.runtime.serve") -> argparse.Namespace:
    """The flags; MODEL (positional, as vLLM and SGLang take it) and --model are one setting."""
    p = build_parser(prog)
    args = p.parse_args(argv)
    if args.model_arg is not None and args.model is not None and args.model_arg != args.model:
        p.error(f"MODEL {args.model_arg!r} and --model {args.model!r} disagree: give one")
    args.model = args.model_arg or args.model or DEFAULT_MODEL
    return args


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else the first line of --api-key-file, else MSTAR_API_KEY; None: no key.
    ValueError for a file that cannot be read or holds no key."""
    if args.api_key:
        return args.api_key
    if args.api_key_file:
        try:
            with open(args.api_key_file) as f:
                key = f.readline().strip()
        except OSError as e:
            raise ValueError(f"cannot read --api-key-file: {e}") from None
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file} holds no key")
        return key
    from mstar import knobs
    return knobs.value("MSTAR_API_KEY") or None


def engine_config(args: argparse.Namespace):
    from mstar.runtime.engine.config import EngineConfig
    return EngineConfig(model=args.model, random_weights=args.random_weights, codec=args.codec, dtype=args.dtype,
                        device=args.device,
                        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, page_size=args.page_size,
                        num_pages=args.num_pages, max_num_batched_tokens=args.max_num_batched_tokens,
                        enable_prefix_caching=not args.no_prefix_caching, tp=args.tp, seed=args.seed,
                        decode_graphs=args.decode_graphs, max_graph_batch=args.max_graph_batch,
                        prefill_graphs=args.prefill_graphs,
                        compile=args.compile, admit_min_free=args.admit_min_free,
                        admit_max_wait=args.admit_max_wait, async_output=args.async_output, warmup=args.warmup)


def _setup_logging(level_name: str | None) -> None:
    if level_name is None:
        try:
            from mstar import knobs
            level_name = knobs.value("MSTAR_LOG_LEVEL")
        except Exception:
            level_name = "info"
    logging.basicConfig(level=getattr(logging, level_name.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def load_tokenizer(model: str):
    """The model's tokenizer, or None (then only token-id prompts are served)."""
    try:
        from mstar.models import load_tokenizer as load
        tok = load(model)
        if tok is not None and len(tok) < 2:  # transformers can build an empty tokenizer from a bare config
            raise ValueError("the tokenizer found is empty")
        return tok
    except Exception as e:  # noqa: BLE001 -- a checkpoint without a tokenizer still serves token ids
        logger.warning("no tokenizer for %s (%s): only token-id prompts will be served, responses carry no text "
                       "(use return_token_ids)", model, e)
        return None


class _Stop(BaseException):
    pass


def main(argv=None, prog: str = "python -m mstar.runtime.serve") -> int:
    """Serve until stopped; the exit code. The signal handlers it sets are put back on return, so a
    caller in the same process (a test, an embedding program) keeps its own."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _main(argv, prog)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        faulthandler.unregister(signal.SIGUSR1)


def _main(argv, prog: str) -> int:
    args = parse_args(argv, prog)
    _setup_logging(args.log_level)
    t0 = time.monotonic()

    # Before uvicorn takes over the signals, SIGTERM/SIGINT abort the start-up cleanly.
    def early_stop(signum, frame):
        raise _Stop()

    signal.signal(signal.SIGTERM, early_stop)
    signal.signal(signal.SIGINT, early_stop)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack to stderr

    from mstar.runtime.engine.engine_process import EngineProcess, EngineStartError

    # the web stack is looked for first (a missing package must not cost a model load) and imported
    # once the engine process is starting, beside it
    missing = [m for m in _WEB_STACK if importlib.util.find_spec(m) is None]
    if missing:
        logger.error("the HTTP server cannot start: no module named %s (pip install fastapi uvicorn python-multipart)",
                     ", ".join(missing))
        return 1
    from mstar.runtime.serving import preflight
    try:
        if args.engine_factory is None:  # a custom engine decides for itself what a model is
            preflight.check_name(args.model, args.random_weights)
            preflight.check_device(args.device, args.tp)
        key = api_key(args)
        config = engine_config(args)
    except ValueError as e:
        logger.error("bad option: %s", e)
        return 2
    if args.port:  # fail fast, before loading a model, when the port is taken
        try:
            with socket.create_server((args.host, args.port), reuse_port=False):
                pass
        except OSError as e:
            logger.error("cannot listen on %s:%s: %s", args.host, args.port, e)
            return 1
    engine = EngineProcess(config, factory=args.engine_factory)
    logger.info("starting the engine process (%.1f s after launch)", time.monotonic() - t0)
    try:
        engine.start()
        try:
            importlib.import_module("uvicorn")
            importlib.import_module("mstar.runtime.serving.api_server")
        except ImportError as e:
            logger.error("the HTTP server cannot start: %s (pip install fastapi uvicorn python-multipart)", e)
            engine.kill()
            return 1
        if args.engine_factory is None:  # the checks that read the model's config, beside the engine's start
            try:
                preflight.check_tp(preflight.check_model(args.model, args.random_weights), args.tp)
            except ValueError as e:
                logger.error("bad option: %s", e)
                engine.kill()
                return 2
        tokenizer = load_tokenizer(args.model)
        if args.chat_template and tokenizer is not None:
            t = args.chat_template
            if os.path.isfile(t):
                with open(t) as f:
                    t = f.read()
            tokenizer.chat_template = t
        info = engine.wait_ready(args.startup_timeout)
    except EngineStartError as e:
        logger.error("%s", e)
        engine.kill()
        return 1
    except _Stop:
        logger.info("stopped during start-up")
        engine.kill()
        return 0
    except BaseException:
        engine.kill()
        raise
    logger.info("engine ready in %.1f s (pid %s, max_model_len %s%s)", time.monotonic() - t0, info.get("pid"),
                info.get("max_model_len"), f", device {info['device']}" if "device" in info else "")
    holder = {"engine": engine}

    def make_engine():
        holder["engine"] = EngineProcess(config, factory=args.engine_factory)
        return holder["engine"]

    try:
        return _serve(args, engine, tokenizer, t0, key, make_engine)
    finally:
        holder["engine"].shutdown()


def _serve(args, engine, tokenizer, t0: float, key: str | None, make_engine) -> int:
    import uvicorn

    from mstar.runtime.serving.api_server import ServerSettings, build_app
    from mstar.runtime.serving.http_timeouts import timed_protocol

    names = args.served_model_name or [args.model]
    settings = ServerSettings(model=args.model, served_model_names=names, api_key=key,
                              max_pending=args.max_pending, max_request_tokens=args.max_request_tokens,
                              overload_policy=args.overload_policy, max_body_bytes=args.max_body_bytes,
                              body_timeout_s=args.timeout_body, max_audio_seconds=args.max_audio_seconds,
                              max_video_jobs=args.max_video_jobs,
                              engine_restarts=args.engine_restarts, startup_timeout_s=args.startup_timeout)
    fatal: dict[str, str] = {}

    def on_fatal(why: str) -> None:  # the engine is gone for good: exit non-zero
        fatal["why"] = why
        server.should_exit = True

    app = build_app(settings, engine, tokenizer, make_engine=make_engine, on_fatal=on_fatal)
    # the drain (api_engine.Server.begin_drain) ends what still runs at --drain-timeout; uvicorn's
    # own timeout, a little later, only catches what that could not end
    uconfig = uvicorn.Config(app, host=args.host, port=args.port, log_level=(args.log_level or "info"),
                             access_log=not args.no_access_log, timeout_graceful_shutdown=args.drain_timeout + 5,
                             lifespan="on", timeout_keep_alive=args.timeout_keep_alive,
                             http=timed_protocol(args.timeout_header))
    stop_early = {"flag": False}

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            app.state.server.begin_drain(args.drain_timeout)
            await super().shutdown(sockets)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            host, port = args.host, args.port
            try:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
            except (AttributeError, IndexError, OSError):
                pass
            shown = f"[{host}]" if ":" in str(host) else host
            logger.info("mstar is serving %s at http://%s:%s (ready in %.1f s)", names[0], shown, port,
                        time.monotonic() - t0)
            if stop_early["flag"]:
                self.should_exit = True

    server = _Server(uconfig)

    def late_stop(signum, frame):  # between here and uvicorn's own handlers
        stop_early["flag"] = True

    signal.signal(signal.SIGTERM, late_stop)
    signal.signal(signal.SIGINT, late_stop)

    code = 0
    try:
        asyncio.run(server.serve())
    except SystemExit as e:  # uvicorn exits (code 3) when it cannot bind; it has logged why
        code = e.code if isinstance(e.code, int) else 1
    except KeyboardInterrupt:
        code = 0
    if fatal:
        logger.error("exiting: %s, and no engine restart is left", fatal["why"])
        return 1
    if code == 0:
        logger.info("shut down cleanly")
    return code


if __name__ == "__main__":
    sys.exit(main())
