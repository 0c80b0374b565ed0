"""What a model family declares to the runtime: its capabilities, the per-request memory it
needs, its stages, and the typed outputs it produces. The runtime reads only these (and the
registry, registry.py); it never imports a family or names a model's layers.

Capabilities (a family's `capabilities`, a frozenset of these names):
    GENERATES_TOKENS   an autoregressive LM: /v1/completions, /v1/chat/completions
    TRANSCRIBES        speech in, text out (an encoder stage, then the autoregressive stage):
                       /v1/audio/transcriptions, /v1/audio/translations
    SYNTHESIZES_SPEECH text in, audio out: /v1/audio/speech
    GENERATES_IMAGES   text in, images out: /v1/images/generations
    GENERATES_VIDEO    text (and an image) in, frames out: /v1/videos
    RECURRENT_STATE    per-request recurrent state (state slots, snapshots for the prefix cache)
    DEVICE_LOOPBACK    decode graphs may read their input tokens from device buffers the sampler
                       writes (MSTAR_INGRAPH_DECODE_TOKENS)

Per-request memory (a model's `memory_specs()`): a list of the typed specs below. The cache
manager allocates each kind; a model binds the tensors it is given (ModelCaches).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

GENERATES_TOKENS = "generates_tokens"
TRANSCRIBES = "transcribes"
SYNTHESIZES_SPEECH = "synthesizes_speech"
GENERATES_IMAGES = "generates_images"
GENERATES_VIDEO = "generates_video"
RECURRENT_STATE = "recurrent_state"
DEVICE_LOOPBACK = "device_loopback"
CAPABILITIES = frozenset({GENERATES_TOKENS, TRANSCRIBES, SYNTHESIZES_SPEECH, GENERATES_IMAGES, GENERATES_VIDEO,
                          RECURRENT_STATE, DEVICE_LOOPBACK})


def capabilities_of(model) -> frozenset[str]:
    """The capabilities a model instance declares (class attribute `capabilities`)."""
    return frozenset(getattr(model, "capabilities", ()) or ())


# --- typed outputs: what a stage hands the API process ----------------------------------------
@dataclass
class AudioChunk:
    """Mono PCM, float32 in [-1, 1], at `sample_rate` Hz; `final`: the last chunk of a request."""
    pcm: np.ndarray
    sample_rate: int
    final: bool = True


@dataclass
class Image:
    """One image, uint8 [height, width, 3] RGB."""
    pixels: np.ndarray


@dataclass
class VideoFrames:
    """Frames, uint8 [frames, height, width, 3] RGB, at `fps` frames per second."""
    frames: np.ndarray
    fps: float
    final: bool = True


MediaOutput = AudioChunk | Image | VideoFrames


# --- stages: how a request's work is batched ------------------------------------------------
@dataclass
class MediaRequest:
    """A request of a non-autoregressive stage: the route's validated fields (`inputs`, e.g.
    {"text": ..., "voice": ...} or {"prompt": ..., "width": ..., "height": ...}) and a seed."""
    request_id: str
    inputs: dict[str, Any]
    seed: int = 0


@dataclass
class OneShotStage:
    """One forward per batch: `run(requests) -> one list of outputs per request`. Requests with
    the same `batch_key(request)` are batched, at most `max_batch` per call."""
    run: Callable[[list[MediaRequest]], list[list[MediaOutput]]]
    batch_key: Callable[[MediaRequest], Any] = lambda r: None
    max_batch: int = 8
    kind: str = "one_shot"


@dataclass
class FixedStepLoopStage:
    """A fixed-step loop (denoising): `start(requests) -> state` for a batch of same-key requests,
    `step(state, i)` for i in range(num_steps(state)), `finish(state) -> one list of outputs per
    request`. Classifier-free guidance is the family's business (extra batch rows inside its state).

    Without `join` / `leave`, requests join a batch only at its start. With both (a stage whose
    state keeps each request's own progress, such as a scheduler state per request), the batch is
    continuous at step granularity: same-key requests that arrive while it runs join it before a
    step, each request runs its own num_steps steps, and one that is done (or aborted) leaves it.
    The rows of the state are the batch's requests in order: the started ones, then each join's.
        join(state, requests) -> state          the requests appended as the last rows (their
                                                first step is the batch's next one)
        leave(state, rows) -> (state, outputs)  those rows (indices, ascending) taken out; one
                                                list of outputs per row, in order
    `step`'s i is then the batch's step count, not any one request's."""
    start: Callable[[list[MediaRequest]], Any]
    step: Callable[[Any, int], Any]
    finish: Callable[[Any], list[list[MediaOutput]]]
    num_steps: Callable[[Any], int]
    batch_key: Callable[[MediaRequest], Any] = lambda r: None
    max_batch: int = 8
    kind: str = "fixed_step_loop"
    join: Callable[[Any, list[MediaRequest]], Any] | None = None
    leave: Callable[[Any, list[int]], tuple[Any, list[list[MediaOutput]]]] | None = None

    @property
    def continuous(self) -> bool:
        return self.join is not None and self.leave is not None


@dataclass
class DecodeLoopStage:
    """An open-ended loop (autoregressive synthesis: one step is one frame of every row), continuous
    at step granularity: same-key requests join a running batch before a step, and each row runs
    until the stage says it is done.
        start(requests) -> state                 a batch of same-key requests (their prefill)
        join(state, requests) -> state           more requests, appended as the last rows
        step(state) -> (state, rows)             one step of every row; rows: one (outputs, done)
                                                 per row, in order: outputs (MediaOutputs) produced
                                                 now, done: the row has ended
        leave(state, rows) -> (state, outputs)   those rows (indices, ascending) taken out; one list
                                                 of their last outputs per row (a done row's final
                                                 chunk; an aborted row's are discarded)
    As the last stage, each step's outputs go to the client as they come (the speech route streams
    them), then a done row's last outputs with its finish; as an earlier stage a request's outputs
    are collected and the next stage gets them all."""
    start: Callable[[list[MediaRequest]], Any]
    step: Callable[[Any], tuple[Any, list[tuple[list[MediaOutput], bool]]]]
    join: Callable[[Any, list[MediaRequest]], Any]
    leave: Callable[[Any, list[int]], tuple[Any, list[list[MediaOutput]]]]
    batch_key: Callable[[MediaRequest], Any] = lambda r: None
    max_batch: int = 8
    kind: str = "decode_loop"


@dataclass
class Pipeline:
    """The stages of a non-autoregressive family, run in order: each stage's outputs of a request
    become the next stage's `inputs["previous"]`; the last stage's outputs go to the client.

    `accepts`: what the routes may send, checked by the API before a request is admitted
    (plain values: it travels to the API process). Keys the routes read, each optional:
        sizes           allowed "WxH" strings (images, videos); the first is the default
        voices          allowed voice names (speech; absent: any)
        max_input_chars longest text input (speech input, image / video prompt)
        max_frames      most frames of a video; fps: its frame rate
    """
    stages: list = field(default_factory=list)
    accepts: dict[str, Any] = field(default_factory=dict)


# --- the runtime hooks of a token-generating family ------------------------------------------
@dataclass
class WarmupRequest:
    """One start-up warm-up request: prompt ids and the admission stage's input (or None)."""
    prompt_ids: list[int]
    encoder_input: Any = None


class AdmissionStage:
    """Work run once per admitted request, batched over the step's admissions, before its first
    forward: an encoder that fills the request's slot of `CacheSpec.cross` (Whisper's audio
    encoder). A preempted or offloaded request loses its slot and runs it again on readmission."""

    def check(self, encoder_input) -> str | None:
        """None if the input can be run, else what is wrong with it (a client error)."""
        return None

    def run(self, inputs: list, slots: list[int]) -> None:
        raise NotImplementedError

    def stats(self) -> dict:
        return {}


class OutputStage:
    """Work on the tokens the autoregressive stage generates, batched over every stream of the
    step: a streaming codec turning a speech LM's audio tokens into AudioChunks as they come.
    Only media requests (EngineRequest.media set) pass through it."""

    def add(self, request_id: str, media: MediaRequest) -> None:
        """A media request was admitted to the engine."""

    def drop(self, request_id: str) -> None:
        """The request left (aborted): forget it."""

    def process(self, outputs: list) -> None:
        """The step's outputs (CoreOutput: request_id, token_ids, finish_reason, media): append
        the typed outputs of the requests it holds to their `media` lists, in place; a finished
        request's last outputs come with its finishing output."""


class EngineHooks:
    """What a token-generating family adds to the autoregressive engine (registry.Family
    .engine_hooks(model, engine_config) builds one; the defaults add nothing).

    admission     an AdmissionStage (Whisper's encoder), or None
    output_stage  an OutputStage the media requests' tokens pass through (a speech codec), or None
    accepts       what the media routes may send (as Pipeline.accepts), for families with media routes
    constrains_logits  True: constrain_logits runs on every sampling step of media requests
    max_allowed_tokens  None, or the most tokens constrain_logits leaves a media row (Orpheus:
                  one codebook's 4096 codes and end of speech): the sampler's candidate stage of
                  that size decides every such row (no full-vocabulary fallback, no host sync)
    logit_ids     None, or int64 ids (a tensor on the model's device, sorted): every token a media
                  request can be sampled as; a step whose sampled rows are all media requests
                  computes the head's logits of these ids alone (the others -inf: the model's
                  compute_logits_of), as a family whose constrain_logits allows no other token
                  gets the same tokens with a fraction of the head's reads
    candidate_ids(request_ids, num_output_tokens)  with logit_ids: each media row's candidate
                  tokens (what constrain_logits leaves it), int64 [rows, M] on the device,
                  ascending, -1 padding; None: the family has no such list. With
                  MSTAR_CANDIDATE_SAMPLING a step of media rows alone samples on these columns
    """

    admission: AdmissionStage | None = None
    output_stage: OutputStage | None = None
    accepts: dict[str, Any] | None = None
    constrains_logits: bool = False
    max_allowed_tokens: int | None = None
    logit_ids: Any = None

    def media_request(self, media: MediaRequest) -> tuple[list[int], dict[str, Any]]:
        """A media request as the autoregressive stage runs it: (prompt ids, SamplingParams
        fields). ValueError("field: message"): the request's inputs are wrong (a client error)."""
        raise ValueError("this model takes token prompts, not media requests")

    def constrain_logits(self, logits, request_ids: list[str], num_output_tokens: list[int]) -> None:
        """In place, before sampling: rows of media requests (by id; others untouched) restricted
        to the tokens allowed at their output position."""

    def candidate_ids(self, request_ids: list[str], num_output_tokens: list[int]):
        """The rows' candidate tokens (see the class docstring), or None."""
        return None

    def suppress_defaults(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(ids never sampled, ids not sampled as the first generated token) of requests that
        do not give their own lists."""
        return (), ()

    def warmup_rounds(self, vocab_size: int, max_len: int, page_size: int) -> list[list[WarmupRequest]] | None:
        """The start-up warm-up's rounds (requests of one step each); None: the runtime's default
        (short token prompts)."""
        return None
