"""TransformersEngine in process: decoding against transformers' own generate and log-softmax, sampling, stops,
prompt logprobs through the artifact's cache, cancellation, the queue bound and shutdown."""

from __future__ import annotations

import queue
import threading

import pytest
import torch
from serve_kit import load_engine, wait_until

from oscar_cli.serve.engine import EngineStopped, Finished, QueueFull, SamplingParams, TokenEvent

PROMPT = "w1 w2 w3 w4"


@pytest.fixture(scope="module")
def engine(word_model, serve_store):
    eng = load_engine(word_model, serve_store)
    yield eng
    eng.stop()


def fresh_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, **kw)


def test_greedy_equals_transformers_generate(engine, word_model):
    ids = engine.encode(PROMPT)
    out = engine.generate(ids, greedy(24, ignore_eos=True))
    ref = fresh_model(word_model).generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                           eos_token_id=None, pad_token_id=1)
    assert out.token_ids == ref[0, len(ids):].tolist()
    assert out.finish_reason == "length" and out.prompt_tokens == len(ids)
    assert out.text == engine.decode(out.token_ids)


def test_sampling_is_seeded_and_top_p_narrows_to_greedy(engine):
    a = engine.generate(PROMPT, SamplingParams(max_tokens=20, temperature=1.0, seed=7, ignore_eos=True))
    b = engine.generate(PROMPT, SamplingParams(max_tokens=20, temperature=1.0, seed=7, ignore_eos=True))
    c = engine.generate(PROMPT, SamplingParams(max_tokens=20, temperature=1.0, seed=8, ignore_eos=True))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids  # 20 draws from a nearly flat 96-way distribution
    narrow = engine.generate(PROMPT, SamplingParams(max_tokens=20, temperature=1.0, top_p=1e-6, seed=3,
                                                    ignore_eos=True))
    assert narrow.token_ids == engine.generate(PROMPT, greedy(20, ignore_eos=True)).token_ids


def test_stop_strings_and_stop_token_ids(engine):
    full = engine.generate(PROMPT, greedy(16, ignore_eos=True))
    words = full.text.split(" ")
    stop = words[5]
    cut = engine.generate(PROMPT, greedy(16, ignore_eos=True, stop=("zzz", stop)))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]
    by_id = engine.generate(PROMPT, greedy(16, ignore_eos=True, stop_token_ids=(full.token_ids[3],)))
    k = full.token_ids.index(full.token_ids[3])
    assert by_id.finish_reason == "stop" and by_id.completion_tokens == k + 1
    assert by_id.token_ids == full.token_ids[:k] and by_id.text == engine.decode(full.token_ids[:k])


def test_eos_ends_generation_unless_ignored(engine, monkeypatch):
    assert 2 in engine.eos_ids  # the word kit's <eos>
    first = engine.generate(PROMPT, greedy(8, ignore_eos=True)).token_ids
    k = next(i for i in range(1, 8) if first[i] not in first[:i])
    monkeypatch.setattr(engine, "eos_ids", {first[k]})  # a later greedy token plays EOS
    out = engine.generate(PROMPT, greedy(8))
    assert out.finish_reason == "stop" and out.completion_tokens == k + 1
    assert out.token_ids == first[:k] and out.text == engine.decode(first[:k])
    assert engine.generate(PROMPT, greedy(8, ignore_eos=True)).token_ids == first


def test_echo_logprobs_equal_log_softmax_of_the_prompt(engine, word_model):
    ids = engine.encode("w5 w9 w13 w2 w40 w41 w7")
    out = engine.generate(ids, greedy(0, echo=True, logprobs=3))
    assert out.token_ids == [] and out.finish_reason == "length"
    logp = torch.log_softmax(fresh_model(word_model)(torch.tensor([ids])).logits[0].float(), -1)
    pl = out.prompt_logprobs
    assert [p.token_id for p in pl] == ids and pl[0].logprob is None
    got = torch.tensor([p.logprob for p in pl[1:]])
    want = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    for i, p in enumerate(pl[1:]):
        top = logp[i].topk(3)
        assert [t[0] for t in p.top] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([t[2] for t in p.top]), top.values, rtol=0, atol=1e-4)


def test_generated_logprobs_are_the_chosen_tokens(engine):
    out = engine.generate(PROMPT, greedy(6, ignore_eos=True, logprobs=2))
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    for lp in out.logprobs:  # greedy: the chosen token is the best alternative
        assert lp.top[0][0] == lp.token_id and lp.top[0][2] == lp.logprob and lp.top[1][2] <= lp.logprob


def test_artifact_prompt_logprobs_are_decode_equivalent(word_model, serve_store, word_artifact, engine):
    """Through the artifact's cache the prefill sees what the decode-equivalent attention gives a decoder (INT2
    beyond sink 4 / recent 8): equal to oscar's teacher-forced scoring, and different from bf16."""
    from oscar_cli.artifact import load_artifact
    from oscar_cli.methods import get_method, scheme_for
    from oscar_cli.prepare import head_dim_of, prepare

    eng = load_engine(word_model, serve_store, word_artifact)
    try:
        assert eng.method == "oscar"
        assert eng.scheme == {"bits": 2, "group": 32, "sink": 4, "recent": 8, "scale_dtype": "fp16",
                              "levels": "uniform"}
        from helpers import WordKit

        ids = eng.encode(WordKit.text(48, seed=5))
        out = eng.generate(ids, greedy(0, echo=True, logprobs=1))
        got = torch.tensor([p.logprob for p in out.prompt_logprobs[1:]])
        ref_model = fresh_model(word_model)
        art = load_artifact(word_artifact)
        m = get_method("oscar")
        prepare(ref_model, m, scheme_for(m, head_dim_of(ref_model.config), artifact_scheme=art.scheme), art)
        logp = torch.log_softmax(ref_model(torch.tensor([ids]), use_cache=False).logits[0].float(), -1)
        want = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
        exact = torch.tensor([p.logprob for p in engine.generate(ids, greedy(0, echo=True, logprobs=1))
                              .prompt_logprobs[1:]])
        assert (got - exact).abs()[:8].max() < 1e-4  # inside sink + recent nothing is quantized
        assert (got - exact).abs()[20:].max() > 1e-3  # beyond them the INT2 cache shows
    finally:
        eng.stop()


def test_a_mixed_width_artifact_serves_with_its_own_allocation(word_model, serve_store, mixed_artifact, engine):
    """An artifact whose scheme allocates 4-bit K/V to some layers and stores fp8 scales: the engine reads the scheme
    from it, and its prompt logprobs are the decode-equivalent scoring of that allocation (not uniform INT2's)."""
    from oscar_cli.artifact import load_artifact
    from oscar_cli.methods import get_method, scheme_for
    from oscar_cli.prepare import head_dim_of, prepare

    art = load_artifact(mixed_artifact)
    s = art.scheme
    assert s.scale_dtype == "fp8" and s.mixed and 2.5 < s.bits_per_element(32, art.layers) <= 3.25
    eng = load_engine(word_model, serve_store, mixed_artifact)
    try:
        assert eng.scheme["bits_k"] == list(s.bits_k) and eng.scheme["scale_dtype"] == "fp8"
        from helpers import WordKit

        ids = eng.encode(WordKit.text(48, seed=5))
        got = torch.tensor([p.logprob for p in eng.generate(ids, greedy(0, echo=True, logprobs=1)).prompt_logprobs[1:]])
        ref_model = fresh_model(word_model)
        m = get_method("oscar")
        prepare(ref_model, m, scheme_for(m, head_dim_of(ref_model.config), artifact_scheme=s), art)
        logp = torch.log_softmax(ref_model(torch.tensor([ids]), use_cache=False).logits[0].float(), -1)
        want = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
        exact = torch.tensor([p.logprob for p in engine.generate(ids, greedy(0, echo=True, logprobs=1))
                              .prompt_logprobs[1:]])
        assert (got - exact).abs()[20:].max() > 1e-4  # beyond sink + recent the quantized cache shows
    finally:
        eng.stop()


def test_cancel_stops_between_tokens(engine):
    """A cancel lands at the next token boundary: cancelled from the engine's own callback on the third token, the
    request ends with at most one more (no timing between threads involved)."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    before = engine.stats.cancelled
    submitted = threading.Event()
    holder = {}
    seen = 0

    def on_event(ev):
        nonlocal seen
        events.put(ev)
        if isinstance(ev, TokenEvent):
            seen += 1
            if seen == 3:
                assert submitted.wait(30)
                holder["req"].cancel()

    holder["req"] = engine.submit(engine.encode(PROMPT), greedy(900, ignore_eos=True), on_event)
    submitted.set()
    while not isinstance(ev := events.get(timeout=30), Finished):
        pass
    assert ev.reason == "cancelled" and ev.completion_tokens <= 4, ev
    assert engine.stats.cancelled == before + 1


def test_queue_bound_and_shutdown(word_model, serve_store):
    eng = load_engine(word_model, serve_store, max_queue=1)
    done: list[Finished] = []
    lock = threading.Lock()

    def sink(ev):
        if isinstance(ev, Finished):
            with lock:
                done.append(ev)

    ids = eng.encode(PROMPT)
    eng.submit(ids, greedy(100_000, ignore_eos=True), sink)  # decoding
    wait_until(lambda: eng.busy)
    eng.submit(ids, greedy(5), sink)  # waiting
    assert eng.queue_depth() == 1
    with pytest.raises(QueueFull, match="queue is full"):
        eng.submit(ids, greedy(5), sink)
    eng.stop(cancel=True, timeout=30)
    assert not eng.running and sorted(f.reason for f in done) == ["cancelled", "cancelled"]
    with pytest.raises(EngineStopped, match="shutting down"):
        eng.submit(ids, greedy(5), sink)
