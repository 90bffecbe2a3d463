"""The OpenAI-compatible server on a real port, through the official ``openai`` client (and lm-eval's own client)."""

from __future__ import annotations

import json
import math
import re
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
import torch
from helpers import WordKit
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_kit import Server, load_engine, wait_until

from oscar_cli.serve.engine import SamplingParams

PROMPT = "w1 w2 w3 w4"


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, **kw)


def idle(engine) -> bool:
    return not engine.busy and engine.queue_depth() == 0


# ----------------------------------------------------------------------------------------------------------------
# shapes and equality with the engine


def test_models_show_artifact_and_scheme(word_model, serve_store, word_artifact):
    srv = Server(load_engine(word_model, serve_store, word_artifact))
    try:
        (card,) = srv.client().models.list().data
        manifest = json.loads((word_artifact / "manifest.json").read_text())
        assert card.id == srv.engine.loaded.slug and card.owned_by == "oscar-kv" and card.max_model_len == 1024
        info = card.oscar
        assert info["method"] == "oscar"
        assert info["artifact"] == {"name": f"{word_artifact.parent.name}/{word_artifact.name}",
                                    "path": str(word_artifact.resolve()), "content_hash": manifest["content_hash"]}
        assert info["scheme"] == {"bits": 2, "group": 32, "sink": 4, "recent": 8, "scale_dtype": "fp16",
                                  "levels": "uniform"}
        assert info["model_fingerprint"] == manifest["model_fingerprint"]
        prompt = WordKit.text(40, seed=3)  # longer than sink + recent: the INT2 part of the cache is read
        c = srv.client().completions.create(model=card.id, prompt=prompt, max_tokens=10, temperature=0,
                                            extra_body={"ignore_eos": True})
        assert c.choices[0].text == srv.engine.generate(prompt, greedy(10, ignore_eos=True)).text
        assert srv.client().models.retrieve(card.id).oscar == info
    finally:
        srv.stop()


def test_completion_equals_engine_generate(bf16_server):
    c = bf16_server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                                extra_body={"ignore_eos": True})
    ref = bf16_server.engine.generate(PROMPT, greedy(12, ignore_eos=True))
    assert c.object == "text_completion" and c.model == "tiny" and c.id.startswith("cmpl-")
    assert c.choices[0].text == ref.text and c.choices[0].finish_reason == "length" and c.choices[0].index == 0
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (4, 12, 16)


def test_completion_batch_of_token_prompts(bf16_server):
    eng = bf16_server.engine
    prompts = [eng.encode("w5 w6"), eng.encode("w7 w8 w9")]
    c = bf16_server.client().completions.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0,
                                                extra_body={"ignore_eos": True})
    assert [ch.index for ch in c.choices] == [0, 1]
    assert [ch.text for ch in c.choices] == [eng.generate(p, greedy(5, ignore_eos=True)).text for p in prompts]
    assert c.usage.prompt_tokens == 5 and c.usage.completion_tokens == 10


def test_streaming_concatenates_to_the_non_streamed_text(bf16_server):
    client = bf16_server.client()
    full = bf16_server.engine.generate(PROMPT, greedy(20, ignore_eos=True)).text
    stop = full.split(" ")[9]  # a stop string inside the text: streamed text is held back, then cut
    for kw in (dict(), dict(stop=[stop])):
        plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0,
                                          extra_body={"ignore_eos": True}, **kw)
        chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}, **kw))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert text == plain.choices[0].text and len(chunks) > 3
        assert chunks[-2].choices[0].finish_reason == plain.choices[0].finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert plain.choices[0].finish_reason == "stop" and plain.choices[0].text == full[: full.find(stop)]
    messages = [{"role": "user", "content": "w11 w12"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=15, temperature=0)
    parts = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=15, temperature=0,
                                                stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == chat.choices[0].message.content
    assert parts[-1].choices[0].finish_reason == chat.choices[0].finish_reason
    raw = requests.post(bf16_server.url + "/completions", stream=True, timeout=30,
                        json={"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "stream": True})
    lines = [ln for ln in raw.iter_lines(decode_unicode=True) if ln]
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    assert all(json.loads(ln[6:])["object"] == "text_completion" for ln in lines[:-1])


def test_chat_goes_through_the_chat_template(bf16_server):
    eng = bf16_server.engine
    messages = [{"role": "system", "content": "w3"}, {"role": "user", "content": "w5 w6 w7"}]
    ids = eng.chat_ids(messages)
    assert eng.decode(ids) == eng.decode(eng.encode("<unk> w3 <unk> w5 w6 w7 w0"))  # roles are unknown words
    r = bf16_server.client().chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                     logprobs=True, top_logprobs=2)
    ref = eng.generate(ids, greedy(10, logprobs=2))
    msg = r.choices[0].message
    assert r.object == "chat.completion" and msg.role == "assistant" and msg.content == ref.text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == ref.completion_tokens
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [lp.text for lp in ref.logprobs]
    assert [c.logprob for c in content] == [lp.logprob for lp in ref.logprobs]
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == c.logprob for c in content)
    parts = [{"role": "system", "content": "w3"},
             {"role": "user", "content": [{"type": "text", "text": "w5 w6"}, {"type": "text", "text": " w7"}]}]
    r2 = bf16_server.client().chat.completions.create(model="tiny", messages=parts, max_tokens=10, temperature=0)
    assert r2.choices[0].message.content == msg.content


# ----------------------------------------------------------------------------------------------------------------
# logprobs as lm-eval reads them


def expected_loglikelihood(engine, word_model, context: str, continuation: str) -> tuple[float, bool]:
    from transformers import AutoModelForCausalLM

    ctx, whole = engine.encode(context), engine.encode(context + continuation)
    model = AutoModelForCausalLM.from_pretrained(str(word_model), dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
    pos = torch.arange(len(ctx) - 1, len(whole) - 1)
    tgt = torch.tensor(whole[len(ctx):])
    return float(logp[pos, tgt].sum()), bool((logp[pos].argmax(-1) == tgt).all())


def test_echo_logprobs_as_lm_eval_reads_them(bf16_server, word_model):
    """The payload lm-eval's local-completions sends for a loglikelihood, parsed by lm-eval's own parser."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    eng = bf16_server.engine
    ctx, whole = eng.encode("w5 w9 w13"), eng.encode("w5 w9 w13 w2 w40")
    for max_tokens in (1, 0):
        payload = {"model": "tiny", "prompt": [whole], "temperature": 0, "max_tokens": max_tokens, "logprobs": 1,
                   "seed": 1234, "echo": True}
        out = requests.post(bf16_server.url + "/completions", json=payload, timeout=30).json()
        lp = out["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == len(whole) + max_tokens and lp["token_logprobs"][0] is None
        assert out["choices"][0]["text"].startswith(eng.decode(whole))
    (ll, greedy_), = LocalCompletionsAPI.parse_logprobs(outputs=requests.post(
        bf16_server.url + "/completions", timeout=30,
        json={**payload, "max_tokens": 1}).json(), tokens=[whole], ctxlens=[len(ctx)])
    want_ll, want_greedy = expected_loglikelihood(eng, word_model, "w5 w9 w13", " w2 w40")
    assert math.isclose(ll, want_ll, abs_tol=1e-4) and greedy_ == want_greedy


def test_lm_eval_local_completions_with_the_remote_tokenizer(bf16_server, word_model):
    """lm-eval's ``local-completions`` model end to end: it finds /tokenizer_info and /tokenize, tokenizes through
    them, sends echo+logprobs requests and reads our answers."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(base_url=bf16_server.url + "/completions", model="tiny", tokenizer_backend="auto",
                             max_retries=1)
    assert lm.tokenizer_backend == "remote"
    pairs = [("w5 w9 w13", " w2 w40"), ("w1 w1", " w3")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)], disable_tqdm=True)
    for (ll, g), (c, t) in zip(got, pairs, strict=True):
        want_ll, want_g = expected_loglikelihood(bf16_server.engine, word_model, c, t)
        assert math.isclose(ll, want_ll, abs_tol=1e-4) and g == want_g
    info = requests.get(bf16_server.base + "/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == "<eos>" and info["model_max_length"] == 1024
    ids = requests.post(bf16_server.base + "/tokenize", json={"prompt": "w4 w5"}, timeout=10).json()["tokens"]
    assert ids == bf16_server.engine.encode("w4 w5")
    assert requests.post(bf16_server.base + "/detokenize", json={"tokens": ids}, timeout=10).json() == \
        {"prompt": "w4 w5"}


# ----------------------------------------------------------------------------------------------------------------
# errors


def _call(srv, kind: str, **body):
    c = srv.client()
    if kind == "chat":
        return c.chat.completions.create(**{"model": "tiny", "messages": [{"role": "user", "content": "w1"}],
                                            "max_tokens": 2, **body})
    return c.completions.create(**{"model": "tiny", "prompt": "w1 w2", "max_tokens": 2, **body})


LONG = " ".join(["w7"] * 1030)
ERRORS = [
    # kind, body, status, code, param, message part
    ("completion", dict(model="nope"), 404, "model_not_found", "model", "the model 'nope' does not exist"),
    ("chat", dict(model="nope"), 404, "model_not_found", "model", "this server serves 'tiny'"),
    ("completion", dict(prompt=LONG), 400, "context_length_exceeded", "prompt",
     "the prompt has 1030 tokens, more than the model's context of 1024"),
    ("completion", dict(max_tokens=-1), 400, "invalid_value", "max_tokens", "max_tokens must be >= 0, got -1"),
    ("completion", dict(max_tokens=1023), 400, "context_length_exceeded", "max_tokens",
     "max_tokens 1023 plus the prompt's 2 tokens exceeds the model's context of 1024"),
    ("chat", dict(max_tokens=5000), 400, "context_length_exceeded", "max_tokens", "exceeds the model's context"),
    ("completion", dict(temperature=2.5), 400, "invalid_value", "temperature", "temperature must be in [0, 2]"),
    ("completion", dict(temperature=-0.1), 400, "invalid_value", "temperature", "temperature must be in [0, 2]"),
    ("completion", dict(top_p=0), 400, "invalid_value", "top_p", "top_p must be in (0, 1]"),
    ("chat", dict(top_p=1.5), 400, "invalid_value", "top_p", "top_p must be in (0, 1]"),
    ("completion", dict(n=2), 400, "invalid_value", "n", "n > 1 is not supported"),
    ("chat", dict(n=0), 400, "invalid_value", "n", "n must be >= 1"),
    ("completion", dict(logprobs=21), 400, "invalid_value", "logprobs", "logprobs must be in [0, 20]"),
    ("chat", dict(top_logprobs=2), 400, "invalid_value", "top_logprobs", "top_logprobs needs logprobs=true"),
    ("chat", dict(messages=[]), 400, "invalid_value", "messages", "messages is empty"),
    ("completion", dict(prompt=[5, 96]), 400, "invalid_value", "prompt", "prompt token ids must be in [0, 96)"),
    ("completion", dict(max_tokens="many"), 400, "invalid_value", "max_tokens", "max_tokens: Input should be"),
    ("completion", dict(max_tokens="8"), 400, "invalid_value", "max_tokens", "Input should be a valid integer"),
    ("chat", dict(stream=1), 400, "invalid_value", "stream", "Input should be a valid boolean"),
]


@pytest.mark.parametrize(("kind", "body", "status", "code", "param", "message"), ERRORS,
                         ids=[f"{k}-{'-'.join(b)}-{s}" for k, b, s, *_ in ERRORS])
def test_request_errors(bf16_server, kind, body, status, code, param, message):
    with pytest.raises(openai.APIStatusError) as e:
        _call(bf16_server, kind, **body)
    assert e.value.status_code == status
    err = e.value.body
    assert set(err) == {"message", "type", "param", "code"}  # the client unwraps {"error": ...}
    assert (err["code"], err["param"], err["type"]) == (code, param, "invalid_request_error")
    assert message in err["message"]


def test_malformed_json_and_unknown_route(bf16_server):
    r = requests.post(bf16_server.url + "/completions", data=b'{"prompt": "w1", ', timeout=10,
                      headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_json" and err["type"] == "invalid_request_error"
    assert err["message"].startswith("the request body is not valid JSON")
    r = requests.post(bf16_server.url + "/chat/completions", data=b"[1, 2]", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["message"] == "the request body must be a JSON object"
    r = requests.get(bf16_server.url + "/engines", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = requests.get(bf16_server.url + "/completions", timeout=10)  # a route without that method
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_a_body_over_the_limit_is_413(word_model, serve_store):
    """A body over ``max_body_bytes`` is refused 413 by its Content-Length before it is read, and while it streams
    when it has none (chunked), on every route that reads a body; the next request under the limit is served."""
    srv = Server(load_engine(word_model, serve_store), model_id="tiny", max_body_bytes=4096)
    try:
        big = json.dumps({"prompt": "w1 " * 3000, "max_tokens": 1}).encode()
        r = requests.post(srv.url + "/completions", data=big, timeout=10, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        assert r.json()["error"]["type"] == "invalid_request_error" and "--max-body-bytes" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: refused while it streams in
            for _ in range(64):
                yield b" " * 1024
        r = requests.post(srv.url + "/chat/completions", data=chunks(), timeout=10)
        assert r.status_code == 413
        r = requests.post(srv.base + "/tokenize", data=big, timeout=10)
        assert r.status_code == 413
        ok = srv.client().completions.create(model="tiny", prompt="w1 " * 300, max_tokens=1)
        assert ok.choices[0].text is not None
    finally:
        srv.stop()


# ----------------------------------------------------------------------------------------------------------------
# concurrency, queue, disconnects


def test_concurrent_requests_are_all_answered_correctly(bf16_server):
    eng = bf16_server.engine
    prompts = [WordKit.text(3 + i, seed=10 + i) for i in range(5)]
    refs = [eng.generate(p, greedy(12, ignore_eos=True)).text for p in prompts]

    def ask(i: int) -> str:
        c = bf16_server.client()
        kw = dict(model="tiny", prompt=prompts[i], max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        if i % 2:
            return "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw))
        return c.completions.create(**kw).choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(ask, range(len(prompts)))) == refs


def _open_stream(srv, max_tokens: int) -> requests.Response:
    r = requests.post(srv.url + "/completions", stream=True, timeout=60,
                      json={"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
                            "ignore_eos": True})
    assert r.status_code == 200
    return r


def test_queue_full_is_429(word_model, serve_store):
    srv = Server(load_engine(word_model, serve_store, max_queue=1), model_id="tiny", max_queue=1)
    try:
        running = _open_stream(srv, 1000)
        wait_until(lambda: srv.engine.busy)
        waiting = _open_stream(srv, 1000)
        wait_until(lambda: srv.engine.queue_depth() == 1)
        with pytest.raises(openai.RateLimitError) as e:
            srv.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
        assert e.value.body["message"] == "the request queue is full (1 waiting); retry later"
        assert e.value.response.headers["retry-after"] == "1"
        running.close()
        waiting.close()
        wait_until(lambda: idle(srv.engine))
        assert srv.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1
    finally:
        srv.stop()


def test_client_disconnect_cancels_generation(bf16_server):
    eng = bf16_server.engine
    wait_until(lambda: idle(eng))
    cancelled, generated = eng.stats.cancelled, eng.stats.generated_tokens
    r = _open_stream(bf16_server, 1000)
    lines = r.iter_lines()
    for _ in range(3):
        assert next(lines).startswith(b"data: ")
        next(lines)
    r.close()
    wait_until(lambda: eng.stats.cancelled == cancelled + 1)
    wait_until(lambda: idle(eng))
    assert eng.stats.generated_tokens - generated < 500  # stopped early, not after 1000 tokens

    # a non-streaming request notices within the poll interval
    cancelled, generated = eng.stats.cancelled, eng.stats.generated_tokens
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", bf16_server.config.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    wait_until(lambda: eng.busy)
    sock.close()
    wait_until(lambda: eng.stats.cancelled == cancelled + 1)
    assert eng.stats.generated_tokens - generated < 1000


# ----------------------------------------------------------------------------------------------------------------
# health and metrics

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{((?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*)\})? '
                     r'([-+]?(?:[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?|Inf)|NaN)$')


def parse_prometheus(text: str) -> dict[tuple[str, frozenset], float]:
    """Strict parse of the text format: every sample belongs to a family declared by # TYPE before it."""
    types: dict[str, str] = {}
    out: dict[tuple[str, frozenset], float] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram") and name not in types
            types[name] = kind
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        name, labels, value = m.groups()
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
        assert family in types, f"{name} has no # TYPE"
        lab = frozenset(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', labels or ""))
        out[(name, lab)] = float(value)
    return out


def test_metrics_parse_and_count(bf16_server):
    eng, client = bf16_server.engine, bf16_server.client()
    wait_until(lambda: idle(eng))

    def scrape():
        r = requests.get(bf16_server.base + "/metrics", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
        return parse_prometheus(r.text)

    def get(m, name, **labels):
        return m.get((name, frozenset(labels.items())), 0.0)

    before = scrape()
    used = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=n, temperature=0,
                                      extra_body={"ignore_eos": True}).usage for n in (3, 5)]
    used.append(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w2"}],
                                               max_tokens=4, temperature=0).usage)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=-1)
    ep = "/v1/completions"

    def counted(m) -> bool:  # a request is counted just after its last byte, possibly after the client read it
        n = get(m, "oscar_request_latency_seconds_count", endpoint=ep)
        return n - get(before, "oscar_request_latency_seconds_count", endpoint=ep) == 3 and \
            get(m, "oscar_requests_in_flight") == 0

    wait_until(lambda: counted(scrape()))
    after = scrape()
    assert get(after, "oscar_requests_total", endpoint=ep, status="200") - \
        get(before, "oscar_requests_total", endpoint=ep, status="200") == 2
    assert get(after, "oscar_requests_total", endpoint=ep, status="400") - \
        get(before, "oscar_requests_total", endpoint=ep, status="400") == 1
    assert get(after, "oscar_requests_total", endpoint="/v1/chat/completions", status="200") - \
        get(before, "oscar_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert get(after, "oscar_generated_tokens_total") - get(before, "oscar_generated_tokens_total") == \
        sum(u.completion_tokens for u in used)
    assert get(after, "oscar_prompt_tokens_total") - get(before, "oscar_prompt_tokens_total") == \
        sum(u.prompt_tokens for u in used)
    count = get(after, "oscar_request_latency_seconds_count", endpoint=ep)
    assert count - get(before, "oscar_request_latency_seconds_count", endpoint=ep) == 3
    buckets = sorted((float(dict(lab)["le"]), v) for (n, lab), v in after.items()
                     if n == "oscar_request_latency_seconds_bucket" and dict(lab)["endpoint"] == ep)
    assert [v for _, v in buckets] == sorted(v for _, v in buckets) and buckets[-1] == (math.inf, count)
    assert get(after, "oscar_request_latency_seconds_sum", endpoint=ep) > 0
    assert get(after, "oscar_queue_depth") == 0 and get(after, "oscar_requests_in_flight") == 0


def test_health(bf16_server):
    r = requests.get(bf16_server.base + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_in_flight_gauge_sees_a_running_request(bf16_server):
    eng = bf16_server.engine
    wait_until(lambda: idle(eng))
    r = _open_stream(bf16_server, 1000)
    lines = r.iter_lines()  # keep the iterator: a collected one closes the connection
    try:
        next(lines)
        text = requests.get(bf16_server.base + "/metrics", timeout=10).text
        assert parse_prometheus(text)[("oscar_requests_in_flight", frozenset())] == 1
    finally:
        r.close()
    wait_until(lambda: idle(eng))


def test_shutdown_ends_each_stream_with_an_error_event_and_done(word_model, serve_store):
    """Past the grace period the server cancels an unfinished stream, which still ends well-formed (an error event
    typed shutting_down, then ``[DONE]``) instead of being cut; a request sent meanwhile is refused (no new
    connections); the lifespan stops the engine's worker."""
    srv = Server(load_engine(word_model, serve_store), grace_s=0.3, model_id="tiny")
    r = _open_stream(srv, 1000)
    lines = r.iter_lines()
    next(lines)
    assert srv.engine.busy
    stopper = threading.Thread(target=srv.stop)
    stopper.start()
    rest = [ln for ln in lines if ln]
    stopper.join(30)
    assert not stopper.is_alive() and not srv.engine.running and not srv.engine.busy
    assert srv.engine.stats.cancelled == 1 and srv.engine.stats.generated_tokens < 1000
    assert rest[-1] == b"data: [DONE]"
    err = json.loads(rest[-2].removeprefix(b"data: "))["error"]
    assert err["code"] == "shutting_down" and err["type"] == "server_error"
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(srv.url + "/models", timeout=5)
    r.close()


def test_shutdown_lets_a_short_stream_finish(word_model, serve_store):
    """Within the grace period a running stream finishes normally (its finish reason, then ``[DONE]``)."""
    srv = Server(load_engine(word_model, serve_store), grace_s=20.0, model_id="tiny")
    r = _open_stream(srv, 300)
    lines = r.iter_lines()
    next(lines)
    assert srv.engine.busy  # still generating when the shutdown begins
    stopper = threading.Thread(target=srv.stop)
    stopper.start()
    rest = [ln for ln in lines if ln]
    stopper.join(30)
    assert not stopper.is_alive() and srv.engine.stats.cancelled == 0
    assert rest[-1] == b"data: [DONE]" and b'"finish_reason": "length"' in rest[-2]
    r.close()


def test_max_context_is_checked_against_the_model(bf16_server):
    from oscar_cli.serve.config import ServeConfig, ServeConfigError
    from oscar_cli.serve.openai_server import create_app

    with pytest.raises(ServeConfigError, match="--max-context 4096 exceeds the model's 1024 positions"):
        create_app(bf16_server.engine, ServeConfig(max_context=4096))
    assert create_app(bf16_server.engine, ServeConfig(max_context=16)).state.context == 16


JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-10, 5000) | st.floats(-1e6, 1e6, width=32)
                       | st.text(max_size=20), lambda c: st.lists(c, max_size=4)
                       | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=10)
FIELDS = st.sampled_from(["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                          "n", "stream", "stream_options", "stop", "stop_token_ids", "seed", "logprobs",
                          "top_logprobs", "echo", "logit_bias", "ignore_eos"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(["/completions", "/chat/completions"]), body=st.dictionaries(FIELDS, JSONISH, max_size=6))
def test_any_request_body_is_answered_or_refused_typed(bf16_server, route, body):
    """Fuzzed bodies: every answer is a 200 or a 4xx with an OpenAI error object of a documented type (never a 5xx,
    never a hang); the server keeps serving."""
    body = {**body, "max_tokens": 2} if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 4 else body
    r = requests.post(bf16_server.url + route, json=body, timeout=30)
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["type"] in ("invalid_request_error", "rate_limit_error") and err["message"]
    assert requests.get(bf16_server.base + "/health", timeout=10).status_code == 200
