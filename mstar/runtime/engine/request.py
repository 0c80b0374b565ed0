"""What a request is, at the boundaries of the engine.

`SamplingParams` is what a user asks for (validated here, with errors that name the
field). `EngineRequest` is what enters the engine core (token ids, no text).
`CoreOutput` is what the core reports per step for each request that moved: new token
ids, their logprobs, and a finish reason once it ends. Text, stop strings and the
OpenAI shapes are handled outside the core (output_processor.py, the server), so the
step loop never detokenizes.

Requests of a non-autoregressive family (the stage engine, stage_engine.py) carry an
interfaces.MediaRequest in `EngineRequest.media` (no token ids) and come back with typed outputs
(interfaces.AudioChunk, Image, VideoFrames) in `CoreOutput.media`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Sequence


class RequestError(ValueError):
    """A request the engine refuses; `field` names the offending parameter."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: none; n >= 0: sampled token's logprob plus top-n
    n: int = 1
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    MAX_LOGPROBS = 20
    # Every value must fit the engine's per-row tensors (int64 seeds, int32 token ids and
    # top_k, float32 temperatures and penalties) and keep the sampling arithmetic finite:
    # a value outside these ranges is refused here, before it can reach a shared step.
    MAX_TOP_K = 2 ** 31 - 1  # a top_k beyond the vocabulary keeps every token (the same as off)
    MAX_TOKENS = 2 ** 31 - 1
    MAX_TEMPERATURE = 100.0  # logits / 100 is already a near-uniform distribution
    MIN_TEMPERATURE = 1e-5  # smaller positive temperatures sample greedily (logits / t overflows float32)
    PENALTY_RANGE = (0.01, 100.0)  # repetition_penalty; beyond it logits * or / it leave float32's range
    MAX_STOP = 64
    MAX_STOP_CHARS = 1024
    MAX_STOP_TOKEN_IDS = 1024
    SEED_RANGE = (-(2 ** 63), 2 ** 64)  # [lo, hi): the engine keeps seed mod 2**63

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        """Build from user-supplied keys; unknown keys are rejected by name."""
        names = {f.name for f in dataclasses.fields(cls)}
        for k in d:
            if k not in names:
                raise RequestError(k, "unknown sampling option")
        p = cls(**d)
        p.validate()
        return p

    def validate(self) -> "SamplingParams":
        """Check every field's type and range (RequestError naming the field); a positive
        temperature below MIN_TEMPERATURE becomes 0 (greedy)."""
        def num(name, v, kind=(int, float)):
            if isinstance(v, bool) or not isinstance(v, kind):
                raise RequestError(name, f"must be a number, got {type(v).__name__}")
            if kind is not int:
                try:
                    ok = math.isfinite(v)
                except OverflowError:  # an int past float's range
                    ok = False
                if not ok:
                    raise RequestError(name, "must be a finite number")

        def in_range(name, v, lo, hi, what):
            if not (lo <= v <= hi):
                raise RequestError(name, f"must be {what}, got {v}")

        num("max_tokens", self.max_tokens, int)
        in_range("max_tokens", self.max_tokens, 1, self.MAX_TOKENS, f"in [1, {self.MAX_TOKENS}]")
        num("temperature", self.temperature)
        in_range("temperature", self.temperature, 0, self.MAX_TEMPERATURE, f"in [0, {self.MAX_TEMPERATURE:g}]")
        if 0 < self.temperature < self.MIN_TEMPERATURE:
            self.temperature = 0.0
        num("top_p", self.top_p)
        if not (0 < self.top_p <= 1):
            raise RequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        num("top_k", self.top_k, int)
        in_range("top_k", self.top_k, -1, self.MAX_TOP_K, f"-1, 0 (off) or in [1, {self.MAX_TOP_K}]")
        num("min_p", self.min_p)
        in_range("min_p", self.min_p, 0, 1, "in [0, 1]")
        if self.seed is not None:
            num("seed", self.seed, int)
            lo, hi = self.SEED_RANGE
            if not (lo <= self.seed < hi):
                raise RequestError("seed", f"must be in [-2**63, 2**64), got {self.seed}")
        num("repetition_penalty", self.repetition_penalty)
        lo, hi = self.PENALTY_RANGE
        in_range("repetition_penalty", self.repetition_penalty, lo, hi, f"in [{lo:g}, {hi:g}]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            num(name, v)
            in_range(name, v, -2, 2, "in [-2, 2]")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise RequestError("stop", "must be a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise RequestError("stop", "stop strings must not be empty")
        if len(self.stop) > self.MAX_STOP or any(len(s) > self.MAX_STOP_CHARS for s in self.stop):
            raise RequestError("stop", f"at most {self.MAX_STOP} strings of at most {self.MAX_STOP_CHARS} "
                                       "characters each")
        self.stop = list(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2 ** 31 for t in self.stop_token_ids):
            raise RequestError("stop_token_ids", "must be a list of token ids (integers in [0, 2**31))")
        if len(self.stop_token_ids) > self.MAX_STOP_TOKEN_IDS:
            raise RequestError("stop_token_ids", f"at most {self.MAX_STOP_TOKEN_IDS} ids")
        self.stop_token_ids = list(self.stop_token_ids)
        num("min_tokens", self.min_tokens, int)
        if not (0 <= self.min_tokens <= self.max_tokens):
            raise RequestError("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None:
            num("logprobs", self.logprobs, int)
            if not (0 <= self.logprobs <= self.MAX_LOGPROBS):
                raise RequestError("logprobs", f"must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs}")
        num("n", self.n, int)
        if not (1 <= self.n <= 128):
            raise RequestError("n", f"must be in [1, 128], got {self.n}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(name, "must be a boolean")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0
    # the input of the family's admission stage (interfaces.AdmissionStage), run when the request
    # is admitted (Whisper: one 16 kHz mono window, or its log-mel features); None for LLMs
    encoder_input: Any = None
    # ids never to sample (None: the model's default, e.g. Whisper's checkpoint list + timestamps)
    # and ids not to sample as the first generated token (None: the model's default)
    suppress_token_ids: Sequence[int] | None = None
    begin_suppress_token_ids: Sequence[int] | None = None
    # non-autoregressive families (stage_engine.py): the request of the family's stages
    # (interfaces.MediaRequest: the route's validated inputs and a seed); None for token requests
    media: Any = None


@dataclass
class TokenLogprobs:
    """Logprob of the sampled token and the top-n alternatives (ids, logprobs)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class CoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_token_id: int | None = None  # the eos or stop id that ended it: kept in new_token_ids (as HF and vLLM do), left out of the text
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    # stage-engine requests: the typed outputs of the last stage (interfaces.AudioChunk, Image,
    # VideoFrames), and what went wrong when finish_reason is "error"; None for token requests
    media: list | None = None
    error: str | None = None
    # stage-engine requests in a fixed-step loop stage: (stage index, steps done, steps) after each step
    progress: tuple[int, int, int] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
