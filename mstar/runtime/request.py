"""What a request is, at the boundaries of the engine.

`SamplingParams` is what a user asks for (validated here, with errors that name the
field). `EngineRequest` is what enters the engine core (token ids, no text).
`CoreOutput` is what the core reports per step for each request that moved: new token
ids, their logprobs, and a finish reason once it ends. Text, stop strings and the
OpenAI shapes are handled outside the core (output_processor.py, the server), so the
step loop never detokenizes.
"""

from __future__ import annotations

import dataclasses
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
        def num(name, v, kind=(int, float)):
            if isinstance(v, bool) or not isinstance(v, kind):
                raise RequestError(name, f"must be a number, got {type(v).__name__}")

        num("max_tokens", self.max_tokens, int)
        if self.max_tokens < 1:
            raise RequestError("max_tokens", f"must be at least 1, got {self.max_tokens}")
        num("temperature", self.temperature)
        if not self.temperature >= 0:
            raise RequestError("temperature", f"must be >= 0, got {self.temperature}")
        num("top_p", self.top_p)
        if not (0 < self.top_p <= 1):
            raise RequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        num("top_k", self.top_k, int)
        if self.top_k < -1:
            raise RequestError("top_k", f"must be -1, 0 (off) or positive, got {self.top_k}")
        num("min_p", self.min_p)
        if not (0 <= self.min_p <= 1):
            raise RequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            num("seed", self.seed, int)
        num("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0:
            raise RequestError("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            num(name, v)
            if not (-2 <= v <= 2):
                raise RequestError(name, f"must be in [-2, 2], got {v}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise RequestError("stop", "must be a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise RequestError("stop", "stop strings must not be empty")
        self.stop = list(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise RequestError("stop_token_ids", "must be a list of non-negative integers")
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
    # encoder-decoder models (Whisper): the encoder input of this sequence, one 16 kHz mono
    # window (1-D float32, <= 30 s) or its log-mel features [n_mels, 3000]; None for LLMs
    audio: Any = None
    # ids never to sample (None: the model's default, Whisper: checkpoint list + timestamps)
    # and ids not to sample as the first generated token (None: the model's default)
    suppress_token_ids: Sequence[int] | None = None
    begin_suppress_token_ids: Sequence[int] | None = None


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
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_token_id: int | None = None  # the eos or stop id that ended it: kept in new_token_ids (as HF and vLLM do), left out of the text
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
