"""From CoreOutputs (token ids) to RequestOutputs (text): incremental detokenization and
stop strings. Runs outside the engine core (same process for the offline API; the API
process for the server), so the step loop never detokenizes.

Incremental detokenization: per request we keep a small window of token ids; each new
token decodes the window with and without it and takes the difference as new text. The
window starts with a few prompt tokens (so the first generated token gets the spacing it
has in context) and slides forward whenever a decode ends in a complete character; while
the text ends in U+FFFD (an incomplete UTF-8 sequence split across byte tokens) nothing is
emitted and the window grows until the character completes. Cost per token: two decodes
of a few tokens, independent of the output length.

Stop strings: after each token the new text is searched (from max_stop_len - 1 characters
back, so a stop string spanning tokens is found) for the earliest occurrence of any stop
string; the output is cut right before it (right after it with include_stop_str_in_output),
finish_reason "stop", stop_reason the string, and the request id is returned so the
caller aborts it in the core. While a request runs with stop strings, the last
max_stop_len - 1 characters are held back from `text` / `text_delta` (they may turn out to
be the start of a stop string). Stop strings are not matched before min_tokens tokens.

A stop token (eos / stop_token_ids, CoreOutput.stop_token_id) stays in token_ids but is
left out of the text (unless include_stop_str_in_output).

`OutputProcessor(tokenizer, cumulative=False)` (the server's): each RequestOutput carries only
what is new (new_token_ids, text_delta, new_logprobs); token_ids, text and logprobs are None
instead of copies of everything so far, which cost O(length) per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mstar.runtime.engine.request import CoreOutput, SamplingParams, TokenLogprobs

_CONTEXT_TOKENS = 5  # prompt tokens that seed the detokenization window


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]  # all generated so far
    new_token_ids: list[int]
    text: str  # all so far (stop string cut)
    text_delta: str
    logprobs: list[TokenLogprobs] | None  # all so far; None unless asked for
    finish_reason: str | None  # "stop" | "length" | "abort"
    stop_reason: str | int | None  # matched stop string or stop token id
    num_prompt_tokens: int
    num_cached_tokens: int
    finished: bool
    prompt_token_ids: list[int] | None = None
    new_logprobs: list[TokenLogprobs] | None = None  # this update's; None unless asked for


def fast_decode(tokenizer):
    """`f(ids, skip_special_tokens)` equal to tokenizer.decode(ids, skip_special_tokens=...,
    clean_up_tokenization_spaces=False) without transformers' Python around the Rust decode
    (~3x cheaper; the detokenizer decodes twice per token), or None where that is not the same
    call: a tokenizer that is not a plain HF fast tokenizer (decode or _decode overridden), or
    one whose results differ on a sample of ids."""
    backend = getattr(tokenizer, "_tokenizer", None)
    rust = getattr(backend, "decode", None)
    if rust is None or type(backend).__module__.split(".")[0] != "tokenizers":
        return None
    mro = type(tokenizer).__mro__
    owner = {name: next((k.__name__ for k in mro if name in k.__dict__), None) for name in ("decode", "_decode")}
    if owner["decode"] != "PreTrainedTokenizerBase" or owner["_decode"] not in ("TokenizersBackend",
                                                                                 "PreTrainedTokenizerFast"):
        return None

    try:
        n = len(tokenizer)
        sample = [list(range(i, min(n, i + 4))) for i in range(0, min(n, 600), 4)]
        sample += [list(range(max(0, n - 40), n))]  # the top of the vocabulary: the special tokens
        for ids in sample:
            for skip in (True, False):
                if rust(ids, skip) != tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False):
                    return None
    except Exception:  # noqa: BLE001 -- then the ordinary decode
        return None
    return rust  # the bound Rust method itself: no Python frame around each decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True, decode=None):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self._fast = decode  # fast_decode(tokenizer), or None
        ctx = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.ids: list[int] = ctx
        self.prefix_offset = 0
        self.read_offset = len(ctx)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._fast is not None:
            return self._fast(ids, self.skip)
        return self.tok.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Append one token; the text it completes (possibly "")."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """At the end: whatever is pending, incomplete characters included."""
        if self.read_offset >= len(self.ids):
            return ""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""


@dataclass
class _State:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # full text so far (uncut)
    emitted: int = 0  # characters already handed out
    logprobs: list[TokenLogprobs] | None = None
    max_stop: int = 0
    num_cached_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer, cumulative: bool = True):
        self.tokenizer = tokenizer
        self.cumulative = cumulative  # False: token_ids / text / logprobs left None (deltas only)
        self._reqs: dict[str, _State] = {}
        self._decode = fast_decode(tokenizer) if tokenizer is not None else None

    def add_request(self, request_id: str, prompt_token_ids, params: SamplingParams) -> None:
        if request_id in self._reqs:
            raise ValueError(f"request {request_id!r} already tracked")
        prompt = list(prompt_token_ids)
        detok = None if self.tokenizer is None else IncrementalDetokenizer(
            self.tokenizer, prompt, params.skip_special_tokens, self._decode)
        if params.stop and detok is None:
            raise ValueError("stop strings need a tokenizer")
        self._reqs[request_id] = _State(
            request_id, prompt, params, detok,
            logprobs=[] if params.logprobs is not None else None,
            max_stop=max((len(s) for s in params.stop), default=0))

    def abort(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)

    def process(self, outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Per-request updates, and the ids whose stop string matched (abort them in the core)."""
        results: list[RequestOutput] = []
        to_abort: list[str] = []
        for co in outputs:
            st = self._reqs.get(co.request_id)
            if st is None:
                continue
            st.num_cached_tokens = co.num_cached_tokens
            finish, stop_reason = co.finish_reason, None
            new_ids = list(co.new_token_ids)
            p = st.params
            text_ids = new_ids
            if co.stop_token_id is not None and new_ids and not p.include_stop_str_in_output:
                text_ids = new_ids[:-1]
            if co.stop_token_id is not None and co.stop_token_id in p.stop_token_ids:
                stop_reason = co.stop_token_id
            new_lps = None
            if co.new_logprobs is not None and st.logprobs is not None:
                new_lps = list(co.new_logprobs)
                st.logprobs.extend(new_lps)
            cut: int | None = None
            base = len(st.token_ids)
            st.token_ids.extend(new_ids)
            if st.detok is not None:
                for i, t in enumerate(text_ids):
                    before = len(st.text)
                    st.text += st.detok.add(t)
                    if p.stop and base + i + 1 > p.min_tokens and len(st.text) > before:
                        hit = self._find_stop(st, before)
                        if hit is not None:
                            cut, stop_reason = hit
                            break
                if cut is None and finish is not None:
                    st.text += st.detok.flush()
                    if p.stop:
                        hit = self._find_stop(st, 0)
                        if hit is not None:
                            cut, stop_reason = hit
            if cut is not None:
                st.text = st.text[:cut]
                if finish is None:
                    to_abort.append(co.request_id)
                finish = "stop"
            finished = finish is not None
            visible = len(st.text)
            if not finished and st.max_stop > 1:
                visible = max(st.emitted, visible - (st.max_stop - 1))
            delta = st.text[st.emitted:visible]
            st.emitted = max(st.emitted, visible)
            if self.cumulative:
                results.append(RequestOutput(
                    request_id=co.request_id, token_ids=list(st.token_ids), new_token_ids=new_ids,
                    text=st.text[:visible], text_delta=delta,
                    logprobs=list(st.logprobs) if st.logprobs is not None else None,
                    finish_reason=finish, stop_reason=stop_reason, num_prompt_tokens=co.num_prompt_tokens,
                    num_cached_tokens=co.num_cached_tokens, finished=finished, prompt_token_ids=st.prompt_ids,
                    new_logprobs=new_lps))
            else:
                results.append(RequestOutput(
                    co.request_id, None, new_ids, None, delta, None, finish, stop_reason, co.num_prompt_tokens,
                    co.num_cached_tokens, finished, None, new_lps))
            if finished:
                del self._reqs[co.request_id]
        return results, to_abort

    @staticmethod
    def _find_stop(st: _State, new_from: int) -> tuple[int, str] | None:
        """Earliest stop string that ends in the text added since `new_from`: (cut, string)."""
        start = max(0, new_from - st.max_stop + 1)
        best: tuple[int, str] | None = None
        for s in st.params.stop:
            i = st.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        return (i + len(s) if st.params.include_stop_str_in_output else i), s
