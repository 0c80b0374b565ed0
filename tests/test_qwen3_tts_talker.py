"""The Qwen3-TTS 12 Hz talker and code predictor (mstar/models/qwen3_tts) against the reference
package (qwen-tts 0.1.1), on a tiny random checkpoint the package saves in the release's layout
(tests/qwen3_tts_helpers.py), loaded through mstar's loader. float32 on the CPU.

- logits of the talker (prefill, then decode steps, rows of different lengths in one batch over
  paged K/V) and of the code predictor: within 1e-5 of the largest logit;
- prompts (CustomVoice with a speaker and a language, "auto" with a dialect speaker, an instruct,
  streaming and non-streaming text, VoiceDesign): the talker's prompt embeddings within 1e-6;
- greedy generation: the package's codes exactly, batched and one row at a time;
- continuous batching: a row joining a running batch gets its codes alone; leaving frees pages;
- sampling: the same seed gives the same codes batched or alone.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from mstar.models.context import ForwardContext
from mstar.models.qwen3_tts.generate import GenerationParams, TalkerGenerator
from mstar.models.qwen3_tts.prompt import PromptBuilder, SpeechRequest
from mstar.models.qwen3_tts.talker import KVPool, PageTable
from mstar.models.qwen3_tts.weights import load_model
from mstar.models.tokenizer import load_tokenizer
from qwen3_tts_helpers import build_reference

MAX_FRAMES = 10  # ours; the package runs with max_new_tokens = MAX_FRAMES + 1 (generate.py)
CASES = [
    dict(kind="custom_voice", text=["Hello there, this is a test.", "短い文です", "The quick brown fox jumps."],
         speaker=["Aiden", "Eric", "vivian"], language=["English", "Auto", "Chinese"],
         instruct=["", "Speak slowly and warmly.", ""], non_streaming=True),
    dict(kind="custom_voice", text=["One two three four five six seven.", "Hi"], speaker=["aiden", "eric"],
         language=["english", "chinese"], instruct=["", ""], non_streaming=False),
    dict(kind="voice_design", text=["A calm voice reading.", "Whisper softly now"],
         instruct=["A deep, calm male voice.", "A bright young female voice, whispering."],
         language=["auto", "english"], non_streaming=True),
]
PROBES = ["<|im_start|>assistant\nHello there, ok?<|im_end|>\n<|im_start|>assistant\n",
          "<|im_start|>user\nA calm user voice.<|im_end|>\n"]


def _alone(case: dict) -> list[dict]:
    return [{k: ([v[i]] if isinstance(v, list) else v) for k, v in case.items()} for i in range(len(case["text"]))]


def _requests(case: dict) -> list[SpeechRequest]:
    n = len(case["text"])
    return [SpeechRequest(text=case["text"][i], speaker=case.get("speaker", [None] * n)[i],
                          language=case["language"][i], instruct=case["instruct"][i] or None,
                          non_streaming=case["non_streaming"]) for i in range(n)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread (on a busy host, more threads mostly wait for each other)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def ref(tmp_path_factory, one_thread):
    d = str(tmp_path_factory.mktemp("qwen3_tts_tiny"))
    cases = [{**c, "max_new_tokens": MAX_FRAMES + 1} for c in CASES]
    cases += [a for c in cases for a in _alone(c)]
    heavy = {"dir": str(tmp_path_factory.mktemp("qwen3_tts_tiny_eos")), "scale": 5.0, "cases": cases[:1]}
    return d, build_reference(d, cases, probe_texts=PROBES, eos_scale=2.0, eos_heavy=heavy), heavy["dir"]


@pytest.fixture(scope="module")
def lm(ref):
    return load_model(ref[0])


@pytest.fixture(scope="module")
def builder(ref, lm):
    return PromptBuilder(lm.config, load_tokenizer(ref[0]))


@pytest.fixture(scope="module")
def gen(lm):
    return TalkerGenerator(lm.talker, lm.config, max_rows=8, num_pages=64, page_size=4)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _run(gen: TalkerGenerator, prompts, params, join=None) -> dict:
    """Generate to the end (rows leave when done); join: (after this many steps, prompts, params, ids)."""
    out = {}

    def take(state, f):
        for i, key in enumerate(f.ids):
            out.setdefault(key, [])
            if not f.is_eos[i]:
                out[key].append(f.codes[i])
        gen.leave(state, np.nonzero(f.done)[0].tolist())

    state, f = gen.start(prompts, params)
    take(state, f)
    steps, pending = 0, join
    while len(state) or pending:
        if pending and steps == pending[0]:
            take(state, gen.join(state, *pending[1:]))
            pending = None
        if len(state):
            take(state, gen.step(state))
        steps += 1
    return {k: torch.stack(v) if v else torch.zeros((0, 16), dtype=torch.int64) for k, v in out.items()}


def test_config_and_tokenizer(ref, lm, builder):
    c = lm.config
    assert c.tts_model_type == "custom_voice" and c.talker.num_code_groups == 16
    assert c.talker.speaker_codec_id("Vivian") == 1062 and sorted(c.talker.languages) == ["auto", "chinese", "english"]
    assert lm.generation_config["top_k"] == 50
    assert lm.talker.code_predictor.small_to_mtp_projection is not None  # widths 64 -> 32
    for text, ids in ref[1]["tokens"].items():
        assert builder.tokenize(text) == ids, text


def test_talker_logits_match_reference(ref, lm):
    rows = ref[1]["talker"]
    talker = lm.talker
    pages = PageTable(KVPool(talker, num_pages=16, page_size=4))
    with torch.inference_mode():
        pos, md = pages.add_rows([r["prefill"].shape[0] for r in rows])
        h = talker(ForwardContext(pos, pos, 0, attn=md), torch.cat([r["prefill"] for r in rows]))
        got = list(talker.logits(h).split([r["prefill"].shape[0] for r in rows]))
        for s in range(rows[0]["decode"].shape[0]):
            pos, md = pages.advance()
            h = talker(ForwardContext(pos, pos, len(rows), attn=md), torch.stack([r["decode"][s] for r in rows]))
            got = [torch.cat([g, lg[None]]) for g, lg in zip(got, talker.logits(h))]
    for g, r in zip(got, rows):
        assert _rel(g, r["logits"]) < 1e-5


def test_code_predictor_logits_match_reference(ref, lm):
    rows = ref[1]["predictor"]
    cp = lm.talker.code_predictor
    cp.bind_cache(len(rows))
    x = torch.stack([r["inputs"] for r in rows])  # [B, G, talker hidden]
    pre, *steps = cp.steps(len(rows))
    with torch.inference_mode():
        h = cp(pre, x[:, :2].reshape(-1, x.shape[-1]))[1::2]
        got = [cp.logits(h, 1)]
        for j in range(2, cp.num_code_groups):
            got.append(cp.logits(cp(steps[j - 2], x[:, j]), j))
    got = torch.stack(got, 1)
    for i, r in enumerate(rows):
        assert _rel(got[i], r["logits"]) < 1e-5


def test_prompts_match_reference(ref, lm, builder):
    talker = lm.talker
    results = ref[1]["cases"][:len(CASES)]
    with torch.inference_mode():
        for case, res in zip(CASES, results):
            for i, req in enumerate(_requests(case)):
                p = builder.build(req)
                got = talker.prompt_embeds(torch.tensor(p.text_ids), torch.tensor(p.codec_ids))
                want = res["prompt"][i]
                assert got.shape == want.shape, (req, got.shape, want.shape)
                assert _rel(got, want) < 1e-6
                trail = res["trailing"][i]  # the batch's trailing text, tts_pad past the row's end
                n = len(p.trailing_ids)
                if n:
                    assert _rel(talker.text_embeds(torch.tensor(p.trailing_ids)), trail[:n]) < 1e-6
                pad = talker.text_embeds(torch.tensor([lm.config.tts_pad_token_id]))
                if n < trail.shape[0]:
                    assert _rel(pad.expand(trail.shape[0] - n, -1), trail[n:]) < 1e-6


@pytest.mark.parametrize("case", range(len(CASES)))
def test_greedy_codes_match_reference(ref, builder, gen, case):
    res = ref[1]["cases"]
    alone_at = len(CASES) + sum(len(c["text"]) for c in CASES[:case])
    prompts = [builder.build(r) for r in _requests(CASES[case])]
    greedy = GenerationParams(do_sample=False, subtalker_dosample=False, max_new_tokens=MAX_FRAMES, seed=0)
    batched = _run(gen, prompts, [greedy] * len(prompts))
    for i, p in enumerate(prompts):
        want = res[case]["codes"][i]
        assert torch.equal(batched[i], want), (case, i, batched[i][:, 0], want[:, 0])
        assert torch.equal(res[alone_at + i]["codes"][0], want)  # the package alone: the same
        assert torch.equal(_run(gen, [p], [greedy])[0], want)
    assert gen.pool.free_pages == gen.pool.num_pages


def test_min_new_tokens_matches_reference(ref, builder):
    """A checkpoint whose EOS wins early: the rows end where the release's min_new_tokens lets them."""
    res = ref[1]["eos_heavy"][0]
    lm = load_model(ref[2])
    gen = TalkerGenerator(lm.talker, lm.config, max_rows=4, num_pages=64, page_size=4)
    prompts = [builder.build(r) for r in _requests(CASES[0])]
    greedy = GenerationParams(do_sample=False, subtalker_dosample=False, max_new_tokens=MAX_FRAMES, seed=0)
    got = _run(gen, prompts, [greedy] * len(prompts))
    at_min = [i for i, c in enumerate(res["codes"]) if len(c) == 2]
    assert at_min, [len(c) for c in res["codes"]]  # some row draws EOS as soon as it may
    for i in range(len(prompts)):
        assert torch.equal(got[i], res["codes"][i]), i
    early = _run(gen, prompts, [dataclasses.replace(greedy, min_new_tokens=0)] * len(prompts))
    assert all(len(early[i]) < 2 for i in at_min)


def test_join_and_leave(builder, gen):
    reqs = _requests(CASES[0]) + _requests(CASES[2])
    prompts = [builder.build(r) for r in reqs]
    params = [GenerationParams(seed=100 + i, max_new_tokens=8, min_new_tokens=8 if i == 0 else 2)
              for i in range(len(prompts))]
    alone = {i: _run(gen, [p], [params[i]])[0] for i, p in enumerate(prompts)}
    # rows 0, 1 start; 2, 3 join after 2 steps, 4 after 4 (into a batch where rows have left)
    first = _run(gen, prompts[:2], params[:2], join=(2, prompts[2:4], params[2:4], [2, 3]))
    assert gen.pool.free_pages == gen.pool.num_pages
    for i in range(4):
        assert torch.equal(first[i], alone[i]), i
    # a batch of rows that cannot end early; one joins, one leaves
    long = [GenerationParams(seed=200 + i, max_new_tokens=8, min_new_tokens=8) for i in range(3)]
    late = _run(gen, prompts[4:], long[2:])[0]
    state, _ = gen.start(prompts[:2], long[:2])
    for _ in range(3):
        gen.step(state)
    first = gen.join(state, prompts[4:], long[2:], ["late"])
    assert state.ids == [0, 1, "late"] and torch.equal(first.codes[0], late[0])
    free, held = gen.pool.free_pages, int(state.pages.n_pages[1])
    gen.leave(state, [1])
    assert state.ids == [0, "late"] and gen.pool.free_pages == free + held
    codes = [gen.step(state).codes[1] for _ in range(2)]
    assert torch.equal(torch.stack(codes), late[1:3])
    gen.leave(state, [0, 1])
    assert len(state) == 0 and gen.pool.free_pages == gen.pool.num_pages


def test_sampled_same_seed_batched_or_alone(builder, gen):
    prompts = [builder.build(r) for r in _requests(CASES[1]) + _requests(CASES[2])]
    params = [GenerationParams(seed=7 + i, max_new_tokens=6) for i in range(len(prompts))]
    batched = _run(gen, prompts, params)
    for i, p in enumerate(prompts):
        assert torch.equal(batched[i], _run(gen, [p], [params[i]])[0]), i
    other = _run(gen, prompts[:1], [GenerationParams(seed=99, max_new_tokens=6)])[0]
    assert not torch.equal(other, batched[0])
    codes = torch.cat(list(batched.values()))
    assert int(codes[:, 0].max()) < 1072 - 1024 and int(codes[:, 1:].max()) < 48


def test_frame_graph_buffers_give_the_eager_codes(lm, builder, gen, monkeypatch):
    """The frame graphs' fixed buffers and padding rows (mode "static": the graph's inputs, run
    eagerly) give every row the eager step's codes and codebook-0 logits, through joins (3 rows
    padded to 4) and leaves, with sampled, greedy and full-vocabulary rows in one batch."""
    logits, plain = [], lm.talker.logits

    def recording(hidden):
        out = plain(hidden)
        logits.append(out)
        return out

    monkeypatch.setattr(lm.talker, "logits", recording)

    def run(g, *a, **kw):
        logits.clear()
        return _run(g, *a, **kw), list(logits)

    graphed = TalkerGenerator(lm.talker, lm.config, max_rows=8, num_pages=64, page_size=4, graphs="static")
    assert graphed.pool.num_pages == gen.pool.num_pages + 1 and graphed.frame_graphs.sizes == [1, 2, 4, 8]
    reqs = _requests(CASES[0]) + _requests(CASES[2]) + _requests(CASES[1])
    prompts = [builder.build(r) for r in reqs]
    rng = np.random.default_rng()
    seeds = rng.integers(0, 2**31, len(prompts)).tolist()
    params = [GenerationParams(seed=s, max_new_tokens=int(rng.integers(4, 9)), min_new_tokens=2) for s in seeds]
    params[1] = dataclasses.replace(params[1], do_sample=False)
    params[2] = dataclasses.replace(params[2], top_k=0, subtalker_top_k=0)  # the full-vocabulary stage
    join = (2, prompts[2:4], params[2:4], [2, 3])
    uniform = [dataclasses.replace(params[0], seed=s) for s in seeds[:3]]
    for ps, kw in ((params[:2], {"join": join}), (uniform, {})):
        (want, want_logits), (got, got_logits) = (run(g, prompts[:len(ps)], ps, **kw) for g in (gen, graphed))
        assert set(got) == set(want)
        for k in want:
            assert torch.equal(got[k], want[k]), k
        assert len(got_logits) == len(want_logits)
        for a, b in zip(got_logits, want_logits):  # padded steps: the first rows are the batch's
            assert _rel(a[:len(b)], b) < 1e-6
    assert graphed.pool.free_pages == graphed.pool.num_pages - 1  # only the padding rows' page is held
