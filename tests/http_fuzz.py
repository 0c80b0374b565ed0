"""What the HTTP fuzz tests share: a live server that is restarted when a request kills its engine,
request bodies written byte by byte (Raw JSON text that json.dumps cannot write), strategies of
nasty values and of mutations of a valid body, and the checks every answer must hold (never a 5xx
or a hang; every 4xx in OpenAI's error schema; strict JSON; well-formed server-sent events; the
server still serving afterwards). Each route family's test module builds its valid bodies and
runs them through these."""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass, field

import httpx
from hypothesis import HealthCheck, currently_in_test_context, event, note, settings
from hypothesis import strategies as st
from server_harness import ServerProc

TIMEOUT_S = 30.0
# not an MSTAR_ name: the server refuses MSTAR_* variables it does not know
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "80"))
BYTE_VOCAB = 259  # the tiny models' byte tokenizer: 256 bytes and 3 special tokens

FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much, HealthCheck.large_base_example])


# =========================================================================================
# the server under test

class LiveServer:
    """A fuzzed server (`python -m mstar.runtime.serve *args`). A request that killed the engine is
    recorded and the server restarted, so that one such example does not fail every later one (nor
    mislead the shrinking)."""

    def __init__(self, *args: str, env: dict | None = None):
        self.args, self.env = args, env
        self.proc = ServerProc(*args, env=env)
        self.client = httpx.Client(timeout=TIMEOUT_S)
        self.deaths: list[str] = []

    @property
    def url(self) -> str:
        return self.proc.url

    def health(self) -> int | None:
        try:
            return self.client.get(self.url + "/health", timeout=10).status_code
        except httpx.HTTPError:
            return None

    def ensure_serving(self) -> None:
        if self.proc.proc.poll() is None and self.health() == 200:
            return
        self.deaths.append(self.proc.log_text()[-3000:])
        self.close()
        self.proc = ServerProc(*self.args, env=self.env)
        self.client = httpx.Client(timeout=TIMEOUT_S)

    def close(self) -> None:
        self.client.close()
        self.proc.close()


# =========================================================================================
# requests: bytes written by hand

@dataclass(frozen=True)
class Raw:
    """JSON text put into a body verbatim: what json.dumps cannot write (deep nesting, 5000-digit
    numbers, lone-surrogate escapes, NaN spelled by hand...)."""
    text: str

    def __repr__(self) -> str:
        return f"Raw({_preview(self.text, 60)})"


def _preview(s, n: int = 200) -> str:
    r = repr(s)
    return r if len(r) <= n else f"{r[:n]}...<{len(s)} in all>"


def encode(body, *, ascii_only: bool = True) -> bytes:
    """JSON bytes of `body` with every Raw spliced in; ascii_only=False writes raw UTF-8 (lone
    surrogates then become invalid UTF-8)."""
    raws: list[str] = []

    def default(o):
        if isinstance(o, Raw):
            raws.append(o.text)
            return f"\x00raw{len(raws) - 1}\x00"
        raise TypeError(type(o).__name__)

    text = json.dumps(body, default=default, ensure_ascii=ascii_only)
    for i, r in enumerate(raws):
        text = text.replace(json.dumps(f"\x00raw{i}\x00"), r, 1)
    return text.encode("utf-8", "surrogatepass")


@dataclass(frozen=True)
class Req:
    method: str
    path: str
    content: bytes = b""
    headers: dict = field(default_factory=dict)
    files: tuple | None = None  # multipart (name, (filename, bytes, type)) pairs
    data: tuple | None = None  # multipart form fields
    stream: bool = False  # the body asks for a stream

    def __repr__(self) -> str:
        extra = f" files={_preview(self.files, 120)} data={self.data}" if self.files or self.data else ""
        return (f"Req({self.method} {self.path} headers={self.headers} body[{len(self.content)}]="
                f"{_preview(self.content.decode('utf-8', 'backslashreplace'), 400)}{extra})")


def json_req(path: str, body, *, ascii_only: bool = True, content_type: str | None = "application/json",
             stream: bool = False) -> Req:
    """POST `body` (Raw values spliced in) to `path`; stream: the body asks for a stream."""
    headers = {"Content-Type": content_type} if content_type is not None else {}
    return Req("POST", path, encode(body, ascii_only=ascii_only), headers, stream=stream)


# =========================================================================================
# strategies: values

SPECIAL_STRINGS = ["", " ", "\x00", "\u2028", "\u2029", "\u0085", "\ufeff", "\ufffd", "\r\n", "\t", "\x1b[0m",
                   "<|im_start|>", "<|im_end|>", "<|endoftext|>", "\U0001f600", "e\u0301", "\uffff",
                   "data: [DONE]\n\n", "{{ raise_exception('x') }}", "{% if %}", "</s>", "null"]
LONE_SURROGATES = [Raw('"\\ud800"'), Raw('"x\\udfffy"'), Raw('"\\udc00\\ud800"'), Raw('"\\ud83d"'),
                   Raw('"ok\\ud83d\\ude00\\ud83d"')]
BOUNDARY_INTS = [0, -1, 1, 2, 20, 21, 127, 128, 129, 255, 256, 258, 259, 2 ** 31 - 1, 2 ** 31, -2 ** 31, 2 ** 32,
                 2 ** 53 + 1, 2 ** 63 - 1, 2 ** 63, -2 ** 63, -2 ** 63 - 1, 2 ** 64 - 1, 2 ** 64, 10 ** 400, -10 ** 400]
BOUNDARY_FLOATS = [0.0, -0.0, 1e-45, 5e-324, 1e-300, 1e-7, 0.5, 1.0, 1.0000001, 2.0, 2.0000001, 1e10, 1e308,
                   1.7976931348623157e308, -1e308, -1e-300, math.inf, -math.inf, math.nan]
RAW_NUMBERS = ["1" + "0" * 400, "-1" + "0" * 400, "9" * 5000, "1e400", "-1e400", "1e-400", "-0", "0e0", "1E+2",
               "2.0e0", "NaN", "-NaN", "Infinity", "-Infinity", "0.0000000000000000000000000000000000000000001"]


def deep_nesting():
    """Raw JSON nested thousands of levels deep (arrays, objects, mixed)."""
    def make(depth: int, kind: str) -> Raw:
        if kind == "array":
            return Raw("[" * depth + "]" * depth)
        if kind == "object":
            return Raw('{"a":' * depth + "1" + "}" * depth)
        return Raw('[{"a":' * depth + "1" + "}]" * depth)
    return st.builds(make, st.sampled_from([64, 1000, 5000, 100_000]), st.sampled_from(["array", "object", "mixed"]))


def huge_strings():
    """Strings from 10 kB to 3 MB."""
    return st.one_of(
        st.builds(lambda n: "x" * n, st.sampled_from([10_000, 100_000, 1_000_000, 3_000_000])),
        st.builds(lambda c, n: c * n, st.sampled_from(["\u00e9", "\u2028", "\x00", "\U0001f600", "ab "]),
                  st.sampled_from([10_000, 300_000])))


def huge_lists():
    """100k token ids, many prompts (made invalid at the end, so they stay cheap), many messages."""
    return st.sampled_from([
        [0] * 100_000,
        list(range(BYTE_VOCAB)) * 400,
        ["x"] * 10_000 + [None],
        [[1, 2]] * 5_000 + [[]],
        [[BYTE_VOCAB]] * 5_000,
        [{"role": "user", "content": "x"}] * 3_000,
        ["stop"] * 10_000,
        [None] * 10_000,
    ])


def short_text():
    return st.one_of(st.text(max_size=24), st.sampled_from(SPECIAL_STRINGS),
                     st.lists(st.sampled_from(SPECIAL_STRINGS + ["a", "hi ", "1"]), max_size=6).map("".join))


def json_values():
    """Arbitrary small JSON, any type."""
    leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), short_text())
    return st.recursive(leaves, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                       st.dictionaries(short_text(), kids, max_size=4)),
                        max_leaves=8)


def extreme_numbers():
    return st.one_of(st.sampled_from(BOUNDARY_INTS), st.sampled_from(BOUNDARY_FLOATS),
                     st.sampled_from(RAW_NUMBERS).map(Raw))


def nasty_values():
    """The values a mutation puts where a field's value was (numbers twice as likely: most fields are)."""
    return st.one_of(
        extreme_numbers(), extreme_numbers(),
        st.sampled_from([None, True, False, "", "1", "0.5", "true", "NaN", [], {}, [1], [[1]], {"a": 1}, [None]]),
        st.sampled_from(LONE_SURROGATES), st.integers(), st.floats(), short_text(), json_values(),
        deep_nesting(), huge_strings(), huge_lists())


# =========================================================================================
# strategies: mutations

UNKNOWN_FIELDS = ["max_token", "foo", "", "\x00", "\u2028", "__proto__", "prompt ", "Prompt", "x" * 1000]


def _container_paths(obj, prefix=(), depth=0):
    """Paths to the values inside dicts and lists (the first and last items of long lists)."""
    if depth > 4:
        return
    if isinstance(obj, dict):
        items = list(obj.items())
    elif isinstance(obj, list):
        idx = sorted({0, 1, len(obj) - 1} & set(range(len(obj))))
        items = [(i, obj[i]) for i in idx]
    else:
        return
    for k, v in items:
        yield prefix + (k,)
        yield from _container_paths(v, prefix + (k,), depth + 1)


def _copy(obj):
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy(v) for v in obj] if len(obj) < 100 else list(obj)
    return obj


@st.composite
def mutated(draw, bodies, fields: list[str]):
    """A body of `bodies` with 0-3 mutations: a field set to a nasty value, dropped, added
    unknown, or a value anywhere inside replaced."""
    body = _copy(draw(bodies))
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["set", "set", "drop", "unknown", "inner"]))
        if op == "set":
            body[draw(st.sampled_from(fields))] = draw(nasty_values())
        elif op == "drop" and body:
            del body[draw(st.sampled_from(sorted(body)))]
        elif op == "unknown":
            body[draw(st.sampled_from(UNKNOWN_FIELDS))] = draw(nasty_values())
        elif op == "inner":
            paths = list(_container_paths(body))
            if paths:
                *head, last = draw(st.sampled_from(paths))
                parent = body
                for k in head:
                    parent = parent[k]
                parent[last] = draw(nasty_values())
    return body


# Content-Types of a JSON route's body
NON_JSON_TYPES = ["text/plain", "text/plain; charset=utf-8", "text/html", "application/x-www-form-urlencoded",
                  "multipart/form-data; boundary=xyz", "application/xml", "application/octet-stream", "image/png"]
JSON_TYPES = ["application/json", "application/json; charset=utf-8", "application/json;charset=UTF-8",
              "Application/JSON"]
UNCLEAR_TYPES = [None, "", "*/*", "application/vnd.openai+json", "application/json-seq", ";;;", "json"]


# =========================================================================================
# the checks

class ServerBug(AssertionError):
    """A property the server broke; one subclass per kind of failure, so that Hypothesis tells
    distinct failures apart (it keys them on the exception's class and line)."""


_BUG_KINDS: dict[str, type] = {}


def fail(kind: str, detail: str = ""):
    kind = kind[:90]
    cls = _BUG_KINDS.get(kind)
    if cls is None:
        name = re.sub(r"\W+", "_", kind).strip("_")[:60] or "Bug"
        cls = _BUG_KINDS[kind] = type(name, (ServerBug,), {})
    raise cls(f"{kind}\n{detail[:2000]}")


def _no_constants(name):
    raise ValueError(f"{name} in JSON")


def strict_json(text: str):
    return json.loads(text, parse_constant=_no_constants)


def is_json_object(raw: bytes) -> bool | None:
    """Whether `raw` is strict UTF-8 JSON text of an object (None: too deep to tell here)."""
    try:
        return isinstance(strict_json(raw.decode("utf-8")), dict)
    except RecursionError:
        return None
    except ValueError:  # UnicodeDecodeError and JSONDecodeError included
        return False


def check_error_body(status: int, raw: bytes) -> dict:
    try:
        obj = strict_json(raw.decode("utf-8"))
    except ValueError as e:
        fail(f"HTTP {status} body is not strict JSON", f"{e}: {raw[:500]!r}")
    err = obj.get("error") if isinstance(obj, dict) else None
    if not (isinstance(obj, dict) and set(obj) == {"error"} and isinstance(err, dict)
            and {"message", "type", "param", "code"} <= set(err) and isinstance(err["message"], str)
            and isinstance(err["type"], str) and (err["param"] is None or isinstance(err["param"], str))
            and (err["code"] is None or isinstance(err["code"], (str, int)))):
        fail(f"HTTP {status} body is not OpenAI's error schema", raw[:500].decode("utf-8", "replace"))
    return err


def check_sse(raw: bytes) -> None:
    """Every data line ASCII-only strict JSON (not an error) or [DONE]; [DONE] last."""
    lines = [ln[:-1] if ln.endswith(b"\r") else ln for ln in raw.split(b"\n")]
    data = []
    for ln in lines:
        if not ln or ln.startswith(b":"):
            continue
        if not ln.startswith(b"data:"):
            if ln.split(b":", 1)[0] in (b"event", b"id", b"retry"):
                continue
            fail("SSE line is not a field", repr(ln[:300]))
        data.append(ln[5:].removeprefix(b" "))
    if not data or data[-1] != b"[DONE]":
        fail("stream does not end with data: [DONE]", repr(raw[-500:]))
    for d in data[:-1]:
        if d == b"[DONE]":
            fail("data: [DONE] before the end of the stream", repr(raw[-500:]))
        try:
            obj = strict_json(d.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            fail("SSE data line is not strict JSON", f"{e}: {d[:300]!r}")
        if isinstance(obj, dict) and "error" in obj:
            fail(f"SSE error event: {obj['error'].get('code') if isinstance(obj['error'], dict) else obj}",
                 repr(d[:500]))
    for d in data:
        if not d.isascii():
            fail("SSE data line is not ASCII", repr(next(c for c in d.decode("utf-8", "replace") if ord(c) > 127))
                 + " in " + repr(d[:300]))


def exchange(live: LiveServer, req: Req) -> tuple[int, dict, bytes]:
    """Send `req`; (status, headers, whole body) within TIMEOUT_S, else a failure."""
    t0 = time.monotonic()
    kw = dict(headers=req.headers, timeout=TIMEOUT_S)
    if req.files or req.data:
        kw.update(files=list(req.files or ()), data=dict(req.data or ()))
    elif req.content or req.method in ("POST", "PUT", "PATCH"):
        kw["content"] = req.content
    body = bytearray()
    try:
        with live.client.stream(req.method, live.url + req.path, **kw) as r:
            for chunk in r.iter_raw():
                body += chunk
                if time.monotonic() - t0 > TIMEOUT_S:
                    fail(f"no complete answer within {TIMEOUT_S:.0f} s", f"{len(body)} bytes so far")
            return r.status_code, dict(r.headers), bytes(body)
    except httpx.TimeoutException as e:
        fail(f"no answer within {TIMEOUT_S:.0f} s ({type(e).__name__})")
    except httpx.TransportError as e:
        fail(f"connection failed: {type(e).__name__}", str(e))


def check(live: LiveServer, req: Req, json_paths=()) -> tuple[int, dict, bytes]:
    """The properties every request must hold (a 2xx of a path in json_paths is JSON whatever its
    Content-Type says); returns (status, headers, body) for more checks."""
    live.ensure_serving()
    if currently_in_test_context():
        note(repr(req))
    status, headers, raw = exchange(live, req)
    if currently_in_test_context():
        event(f"HTTP {status}")  # the mix of outcomes: --hypothesis-show-statistics
    ctype = headers.get("content-type", "")
    if status >= 500 or status < 200 or 300 <= status < 400:
        try:
            msg = strict_json(raw.decode("utf-8", "replace"))["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = raw[:80].decode("utf-8", "replace")
        fail(f"HTTP {status}: {re.sub(r'[0-9]+', 'N', msg)[:70]}",
             f"location: {headers.get('location')}\n{raw[:1000].decode('utf-8', 'replace')}")
    if status >= 400:
        check_error_body(status, raw)
    elif req.stream:
        if not ctype.startswith("text/event-stream"):
            fail("stream: true not answered with server-sent events", f"{ctype}: {raw[:300]!r}")
        check_sse(raw)
    elif ctype.startswith("application/json") or req.path in json_paths:
        try:
            strict_json(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            fail("2xx body is not strict JSON", f"{ctype}: {e}: {raw[:300]!r}")
    h = live.health()
    if h != 200:
        fail(f"the server does not serve after the request (/health {h})", live.proc.log_text()[-2000:])
    return status, headers, raw
