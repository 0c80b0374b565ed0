"""EngineCore and LLM behaviour beyond the gate: request validation, abort semantics,
min_tokens, logprobs, penalties, the offline API, stats, config errors."""

from __future__ import annotations

import pytest

from engine_helpers import POOL_SEED, assert_no_leaks, engine, hf_greedy, llm, prompts, run_all
from engine_helpers import single_thread  # noqa: F401 -- autouse fixture
from mstar.runtime.engine.config import EngineConfig
from mstar.runtime.engine.request import EngineRequest, RequestError, SamplingParams

PS = prompts(8, 3, 30, seed=POOL_SEED)
G = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def core():
    return engine("qwen3.5", page_size=8, max_model_len=64, max_num_seqs=8)


@pytest.mark.parametrize("prompt, params, field", [
    ([], G, "prompt"),
    ([1] * 64, G, "prompt"),
    ([1] * 60, SamplingParams(max_tokens=5), "max_tokens"),
    ([1, 2, 10_000], G, "prompt"),
    ([1, -1], G, "prompt"),
    ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
    ([1, 2], SamplingParams(temperature=-1.0), "temperature"),
    ([1, 2], SamplingParams(top_p=0.0), "top_p"),
    ([1, 2], SamplingParams(top_p=1.5), "top_p"),
    ([1, 2], SamplingParams(stop_token_ids=[100_000]), "stop_token_ids"),
])
def test_bad_requests_rejected_by_field(core, prompt, params, field):
    with pytest.raises(RequestError) as e:
        core.add_request(EngineRequest("bad", prompt, params))
    assert e.value.field == field
    # the engine keeps serving, and the id was not taken
    got = run_all(core, [EngineRequest("bad", PS[0], G)])
    assert got["bad"] == (hf_greedy("qwen3.5", PS[0], 8), "length")


def test_unknown_option_and_duplicate_id(core):
    with pytest.raises(RequestError) as e:
        SamplingParams.from_dict({"max_tokens": 3, "temprature": 0.5})
    assert e.value.field == "temprature"
    core.add_request(EngineRequest("dup", PS[1], G))
    with pytest.raises(RequestError) as e:
        core.add_request(EngineRequest("dup", PS[1], G))
    assert e.value.field == "request_id"
    run_all(core, [])
    assert_no_leaks(core)


def test_abort_semantics(core):
    core.add_request(EngineRequest("w", PS[0], SamplingParams(max_tokens=30, ignore_eos=True)))
    core.add_request(EngineRequest("r", PS[1], SamplingParams(max_tokens=30, ignore_eos=True)))
    core.step()
    core.step()
    assert core.stats()["running"] == 2
    core.abort(["r", "unknown"])
    core.abort("w")
    assert core.stats()["running"] == 0 and core.has_unfinished()  # outputs still to deliver
    assert core.cm.stats().free_slots == core.cm.stats().total_slots
    outs = core.step()
    assert sorted((o.request_id, o.finish_reason, o.new_token_ids) for o in outs) == [
        ("r", "abort", []), ("w", "abort", [])]
    assert not core.has_unfinished() and core.step() == []
    # abort before it was ever scheduled
    core.add_request(EngineRequest("q", PS[2], G))
    core.abort(["q"])
    assert [o.finish_reason for o in core.step()] == ["abort"]
    core.abort(["q"])  # twice: ignored
    assert core.step() == []
    assert_no_leaks(core)
    assert not core._t_added  # the one aborted before admission left no arrival time behind


def test_admission_stats_count_steps_and_waits(core):
    """How requests entered steps: a burst added together is one admission step; one added
    while another runs is a second; the wait is from add_request to the first admission."""
    import time
    s0 = core.stats()
    for i in range(3):
        core.add_request(EngineRequest(f"burst{i}", PS[i], G))
    time.sleep(0.05)
    core.step()  # all three admitted and prefilled in this step
    run_all(core, [EngineRequest("late", PS[3], G)])
    s1 = core.stats()
    assert s1["num_admitted"] - s0["num_admitted"] == 4
    assert s1["num_admission_steps"] - s0["num_admission_steps"] == 2
    assert s1["num_prefill_steps"] - s0["num_prefill_steps"] >= 2
    waited = s1["admission_wait_seconds"] - s0["admission_wait_seconds"]
    assert 3 * 0.05 <= waited < 3 * 0.05 + 5.0, waited
    assert not core._t_added


def test_min_tokens_and_stop_token_ids(core):
    ref = hf_greedy("qwen3.5", PS[3], 8)
    stop = ref[0]
    got = run_all(core, [EngineRequest("a", PS[3], SamplingParams(max_tokens=8, temperature=0.0,
                                                                   stop_token_ids=[stop]))])
    assert got["a"] == ([stop], "stop")
    got = run_all(core, [EngineRequest("b", PS[3], SamplingParams(max_tokens=8, temperature=0.0, min_tokens=4,
                                                                   stop_token_ids=[stop]))])
    toks, fin = got["b"]
    assert len(toks) >= 5 or fin == "length"
    assert stop not in toks[:4]
    assert fin == "length" or toks[-1] == stop


def test_logprobs(core):
    p = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True)
    core.add_request(EngineRequest("lp", PS[4], p))
    core.add_request(EngineRequest("nolp", PS[5], G))
    lps, toks = [], []
    while core.has_unfinished():
        for o in core.step():
            if o.request_id == "lp":
                lps += o.new_logprobs
                toks += o.new_token_ids
            else:
                assert o.new_logprobs is None
    assert len(lps) == 4
    for t, lp in zip(toks, lps):
        assert len(lp.top_ids) == 3 and lp.top_ids[0] == t and abs(lp.top_logprobs[0] - lp.logprob) < 1e-6
        assert lp.logprob <= 0


def test_penalties_change_output_and_reproduce(core):
    base = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    # penalties that reward repeats, so that greedy visibly changes on a random model
    pen = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=0.3,
                         frequency_penalty=-1.0, presence_penalty=-1.0)
    alone = run_all(core, [EngineRequest("p", PS[6], pen)])["p"][0]
    plain = run_all(core, [EngineRequest("n", PS[6], base)])["n"][0]
    assert alone != plain
    assert len(set(alone)) < len(set(plain)) and set(alone) & set(PS[6])
    batch = run_all(core, [EngineRequest("x", PS[7], base), EngineRequest("p2", PS[6], pen),
                           EngineRequest("y", PS[5], pen)])
    assert batch["p2"][0] == alone
    assert_no_leaks(core)


def test_length_at_max_model_len(core):
    p = PS[0][:10]
    got = run_all(core, [EngineRequest("m", p, SamplingParams(max_tokens=64 - len(p), temperature=0.0,
                                                               ignore_eos=True))])
    assert got["m"][1] == "length" and len(got["m"][0]) == 64 - len(p)


def test_stats_keys(core):
    s = core.stats()
    for k in ("running", "waiting", "kv_pages_used", "kv_pages_total", "kv_usage", "prefix_hit_rate",
              "prefix_queries", "prefix_hit_tokens", "num_preemptions"):
        assert k in s
    assert core.max_model_len == 64 and 258 in core.eos_token_ids


def test_llm_generate_and_chat():
    m = llm("qwen3", page_size=16)
    ids_out = m.generate([PS[0], PS[1]], G)
    assert [o.token_ids for o in ids_out] == [hf_greedy("qwen3", PS[0], 8), hf_greedy("qwen3", PS[1], 8)]
    text = "hello there"
    (o,) = m.generate(text, G)
    assert o.token_ids == hf_greedy("qwen3", m.tokenizer.encode(text), 8)
    assert o.num_prompt_tokens == len(m.tokenizer.encode(text)) and o.finished
    outs = m.generate(["a", "bb", "ccc"], [G, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), G])
    assert [len(x.token_ids) for x in outs] == [8, 3, 8]
    chats = m.chat([[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]], G)
    assert len(chats) == 2 and all(len(c.token_ids) == 8 for c in chats)
    with pytest.raises(RequestError) as e:
        m.generate(["x", ""], G)
    assert e.value.field == "prompt"
    with pytest.raises(RequestError):
        m.generate("x", SamplingParams(n=2))
    assert m.generate("x", G)[0].token_ids  # still serving
    assert_no_leaks(m.engine)


def test_llm_default_preset():
    from mstar import LLM
    m = LLM(max_num_seqs=4, max_model_len=128)
    (o,) = m.generate("Hello", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), use_tqdm=True)
    assert len(o.token_ids) == 5 and isinstance(o.text, str) and o.finish_reason == "length"


def test_engine_config_errors():
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(preemption_mode="swap")
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="float8")
    with pytest.raises(ValueError, match="bogus"):
        EngineConfig.from_kwargs(bogus=1)
    c = EngineConfig(device="cpu")
    assert str(c.resolve_dtype()) == "torch.float32" and c.resolve_max_model_len(262144) == 4096


@pytest.mark.gpu
def test_engine_on_cuda_matches_cpu():
    """Device plumbing (pinned step buffers, device-resident sampler tables, offload to host):
    the tiny preset in fp32 on CUDA gives the CPU's greedy tokens and reproduces seeds."""
    import torch

    from mstar.runtime.engine.engine_core import EngineCore

    torch.backends.cuda.matmul.allow_tf32 = False
    ps = [[t % 259 for t in p] for p in prompts(12, 3, 60, seed=5)]  # the preset's byte vocab
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    pen = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=0.5,
                         frequency_penalty=-0.5, logprobs=2, min_tokens=4, stop_token_ids=[1])

    def reqs():
        rs = [EngineRequest(f"g{i}", p, greedy) for i, p in enumerate(ps)]
        return rs + [EngineRequest("s", ps[0], seeded), EngineRequest("p", ps[1], pen)]

    def run(device, **kw):
        core = EngineCore(EngineConfig(model="tiny-qwen3.5", dtype="float32", device=device, page_size=8,
                                       max_num_batched_tokens=48, max_model_len=256, **kw))
        out = run_all(core, reqs())
        assert_no_leaks(core)
        return out, core

    cpu, _ = run("cpu")
    gpu, _ = run("cuda")
    agree = sum(gpu[k][0] == cpu[k][0] for k in cpu)
    assert agree >= len(cpu) - 1, {k: (cpu[k][0], gpu[k][0]) for k in cpu if gpu[k][0] != cpu[k][0]}
    for mode in ("offload", "recompute"):
        small, core = run("cuda", num_pages=24, preemption_mode=mode)
        assert core.scheduler.num_preemptions > 0
        assert sum(small[k][0] == gpu[k][0] for k in gpu) >= len(gpu) - 1, mode
    alone = run_all(EngineCore(EngineConfig(model="tiny-qwen3.5", dtype="float32", device="cuda")),
                    [EngineRequest("s", ps[0], seeded)])
    assert alone["s"][0] == gpu["s"][0]
