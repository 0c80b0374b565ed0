"""OutputProcessor: incremental detokenization, stop strings across token boundaries,
hold-back of possible stop-string prefixes, stop tokens left out of the text."""

from __future__ import annotations

import pytest

from mstar.runtime.engine.output_processor import IncrementalDetokenizer, OutputProcessor
from mstar.runtime.engine.request import CoreOutput, SamplingParams, TokenLogprobs


class PieceTokenizer:
    """id -> string piece; decode concatenates (special ids skipped on request)."""

    def __init__(self, pieces: list[str], special: set[int] = frozenset()):
        self.pieces = pieces
        self.special = set(special)

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(self.pieces[i] for i in ids if not (skip_special_tokens and i in self.special))


PIECES = ["<eos>", "Hello", " wor", "ld", "!", " S", "TO", "P", " end", "\n", "ST", "OP"]
TOK = PieceTokenizer(PIECES, special={0})


def ids(*words):
    return [PIECES.index(w) for w in words]


def feed(proc, rid, token_ids, *, finish_last=None, stop_token=None, one_by_one=True):
    outs, aborts = [], []
    chunks = [[t] for t in token_ids] if one_by_one else [token_ids]
    for k, ch in enumerate(chunks):
        last = k == len(chunks) - 1
        co = CoreOutput(rid, ch, finish_reason=finish_last if last else None,
                        stop_token_id=stop_token if last else None, num_prompt_tokens=3)
        o, a = proc.process([co])
        outs += o
        aborts += a
        if o and o[-1].finished:
            break
    return outs, aborts


def test_plain_text_and_deltas():
    proc = OutputProcessor(TOK)
    proc.add_request("r", [1, 2], SamplingParams(max_tokens=10))
    outs, aborts = feed(proc, "r", ids("Hello", " wor", "ld", "!"), finish_last="length")
    assert not aborts
    assert "".join(o.text_delta for o in outs) == "Hello world!"
    assert outs[-1].text == "Hello world!" and outs[-1].finish_reason == "length" and outs[-1].finished
    assert outs[-1].token_ids == ids("Hello", " wor", "ld", "!")
    assert not proc.has_request("r")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(include):
    proc = OutputProcessor(TOK)
    proc.add_request("r", [1], SamplingParams(max_tokens=10, stop=["STOP"], include_stop_str_in_output=include))
    outs, aborts = feed(proc, "r", ids("Hello", " S", "TO", "P", " end"))
    assert aborts == ["r"]  # the core must abort it
    last = outs[-1]
    assert last.finished and last.finish_reason == "stop" and last.stop_reason == "STOP"
    assert last.text == ("Hello STOP" if include else "Hello ")
    assert "".join(o.text_delta for o in outs) == last.text
    # the " end" token was never fed: the output stopped at the token completing "STOP"
    assert len(outs) == 4


def test_stop_string_not_emitted_early():
    """While running, a possible stop-string prefix is held back from the text."""
    proc = OutputProcessor(TOK)
    proc.add_request("r", [1], SamplingParams(max_tokens=10, stop=["STOP"]))
    o1, _ = proc.process([CoreOutput("r", ids("Hello"))])
    o2, _ = proc.process([CoreOutput("r", ids(" S"))])
    # "Hello S": the last 3 characters may start "STOP"
    assert o1[0].text + o2[0].text_delta == o2[0].text
    assert "S" not in o2[0].text
    proc.process([CoreOutput("r", ids("TO"))])
    o4, a = proc.process([CoreOutput("r", ids("P"))])
    assert a == ["r"] and o4[0].text == "Hello "


def test_stop_string_inside_one_token_and_earliest_wins():
    proc = OutputProcessor(TOK)
    proc.add_request("r", [1], SamplingParams(max_tokens=10, stop=["OP", "ld!"]))
    outs, _ = feed(proc, "r", ids("Hello", " wor", "ld", "!", "ST", "OP"))
    assert outs[-1].text == "Hello wor" and outs[-1].stop_reason == "ld!"


def test_stop_string_found_at_finish_flush():
    """A stop string completed by the last token of a finished (length) output still cuts."""
    proc = OutputProcessor(TOK)
    proc.add_request("r", [1], SamplingParams(max_tokens=3, stop=["STOP"]))
    outs, aborts = feed(proc, "r", ids("ST", "OP"), finish_last="length")
    assert aborts == []  # the core already finished it
    assert outs[-1].finish_reason == "stop" and outs[-1].text == ""


def test_stop_token_left_out_of_text():
    proc = OutputProcessor(TOK)
    proc.add_request("a", [1], SamplingParams(max_tokens=10, stop_token_ids=[4]))
    outs, _ = feed(proc, "a", ids("Hello", "!"), finish_last="stop", stop_token=4)
    assert outs[-1].text == "Hello" and outs[-1].stop_reason == 4 and outs[-1].token_ids == ids("Hello", "!")
    proc.add_request("b", [1], SamplingParams(max_tokens=10))
    outs, _ = feed(proc, "b", ids("Hello") + [0], finish_last="stop", stop_token=0)
    assert outs[-1].text == "Hello" and outs[-1].stop_reason is None  # eos: no stop_reason
    proc.add_request("c", [1], SamplingParams(max_tokens=10, stop_token_ids=[4], include_stop_str_in_output=True))
    outs, _ = feed(proc, "c", ids("Hello", "!"), finish_last="stop", stop_token=4)
    assert outs[-1].text == "Hello!"


def test_min_tokens_delays_stop_strings():
    proc = OutputProcessor(TOK)
    proc.add_request("r", [1], SamplingParams(max_tokens=10, min_tokens=3, stop=["STOP"]))
    outs, aborts = feed(proc, "r", ids("ST", "OP", " S", "TO", "P"))
    # the first STOP ends inside the first 3 tokens; the second one counts
    assert aborts == ["r"] and outs[-1].text == "STOP "


def test_logprobs_accumulate_and_abort():
    proc = OutputProcessor(TOK)
    proc.add_request("r", [1], SamplingParams(max_tokens=10, logprobs=1))
    lp = TokenLogprobs(-0.5, [1], [-0.5])
    o, _ = proc.process([CoreOutput("r", ids("Hello"), [lp])])
    o, _ = proc.process([CoreOutput("r", ids("!"), [lp]), CoreOutput("zzz", [1])])  # unknown id ignored
    assert len(o) == 1 and len(o[0].logprobs) == 2
    o, _ = proc.process([CoreOutput("r", [], finish_reason="abort")])
    assert o[0].finish_reason == "abort" and o[0].text == "Hello!" and o[0].finished
    assert not proc.has_request("r")
    proc.add_request("q", [1], SamplingParams())
    proc.abort("q")
    assert proc.process([CoreOutput("q", [1])]) == ([], [])


def test_utf8_split_over_byte_tokens():
    from mstar.models.tokenizer import byte_tokenizer
    tok = byte_tokenizer()
    text = "añ€😀b"
    tids = list(text.encode())
    proc = OutputProcessor(tok)
    proc.add_request("r", tok.encode("hi"), SamplingParams(max_tokens=20, stop=["😀"]))
    outs, aborts = feed(proc, "r", tids)
    assert aborts == ["r"]
    assert outs[-1].text == "añ€"
    assert all("\ufffd" not in o.text_delta for o in outs)


def test_incremental_equals_full_decode_on_real_tokenizer():
    """Whatever the tokenizer, the concatenated deltas equal a decode of all tokens."""
    from mstar.models.tokenizer import byte_tokenizer
    tok = byte_tokenizer()
    ids_ = list("Zürich – 東京 ok".encode()) + [257, 65, 258, 66]
    d = IncrementalDetokenizer(tok, [72, 105], skip_special_tokens=True)
    text = "".join(d.add(t) for t in ids_) + d.flush()
    assert text == tok.decode(ids_, skip_special_tokens=True)
