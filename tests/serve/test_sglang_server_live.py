"""A real SGLang 0.5.17 server with the OSCAR backend and its radix cache, on the GPU machine.

* **Prefix caching keeps retrieval**: two long prefixes (A and B: the same keys, different numbers) hide needles
  from the first tokens (the sinks) to the last ones (the recent window of the prefix). Every question is asked cold
  (alone after ``/flush_cache``), then the prefixes are cached by one request each (misses) and all questions of
  both are asked together (hits, ``cached_tokens`` > 0). A hit must retrieve every needle its cold run retrieved,
  never answer with the other prefix's number (pages of another request), and give the answer tokens the
  probabilities of the cold run within :func:`answer_tolerance`.
* **Bad requests and refused launches** (``docs/RELIABILITY.md``): a request longer than the model's context is
  answered 400 in one message and the server keeps serving; a launch with a flag the plugin refuses, and one with an
  artifact whose manifest was edited, exit non-zero with the plugin's one-line reason.

Needs SGLang (its site on ``PYTHONPATH``, the plugin installed: ``benchmarks/sglang_h200.sh`` does both), CUDA, and
``OSCAR_LIVE_MODEL`` (a converted model folder) with ``OSCAR_LIVE_ARTIFACT`` (an artifact fitted for it);
``OSCAR_LIVE_URL`` points the tests at a server already serving them (else the module starts one). Skipped
elsewhere."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from oscar_cli.tasks.niah import QUESTION  # the needle grid's question, asked the same way

pytest.importorskip("sglang.srt.plugins", reason="SGLang is not installed here (it pins a CUDA torch)")
torch = pytest.importorskip("torch")
MODEL, ARTIFACT = os.environ.get("OSCAR_LIVE_MODEL"), os.environ.get("OSCAR_LIVE_ARTIFACT")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not (MODEL and ARTIFACT), reason="set OSCAR_LIVE_MODEL and OSCAR_LIVE_ARTIFACT"),
]

PREFIX_TOKENS = 3000
DEPTHS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
"""Needle positions as fractions of the prefix: 0.0 is its first tokens (sinks), 1.0 its last (recent window)."""
KEYS = ("amber-falcon", "cobalt-harbor", "juniper-lantern", "meadow-nickel", "orchid-quartz", "falcon-meadow")
NEW_TOKENS = 12
START_TIMEOUT_S = 900


# ---------------------------------------------------------------------------------------------------- plumbing
def call(url: str, path: str, body: dict | None = None, timeout: float = 300) -> tuple[int, dict]:
    """(status, JSON body) of one request; HTTP errors are returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, (json.loads(raw) if raw.strip().startswith((b"{", b"[")) else {"text": raw.decode()})
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"text": raw.decode(errors="replace")}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server's URL: ``OSCAR_LIVE_URL`` or one started here with the plugin's own launch line."""
    if os.environ.get("OSCAR_LIVE_URL"):
        yield os.environ["OSCAR_LIVE_URL"].rstrip("/")
        return
    from oscar_cli.bench.server import Server
    from oscar_cli.serve.sglang.launch import build_launch

    port = int(os.environ.get("OSCAR_LIVE_PORT", "30123"))
    argv, env = build_launch(MODEL, Path(ARTIFACT), "127.0.0.1", port, ["--cuda-graph-max-bs-decode", "16"])
    work = tmp_path_factory.mktemp("sglang")
    srv = Server(argv, env, work / "server.log", port, cwd=work)
    try:
        srv.wait_ready(START_TIMEOUT_S)
        yield srv.url
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


def generate(url: str, ids: list[int]) -> dict:
    status, out = call(url, "/generate", {"input_ids": ids, "return_logprob": True,
                                          "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS}})
    assert status == 200, out
    return out


def flush(url: str) -> None:
    status, out = call(url, "/flush_cache", {})
    assert status == 200, out


# ---------------------------------------------------------------------------------------------------- needles
def needle_prefixes(tok) -> dict[str, tuple[list[int], dict[str, str]]]:
    """name -> (prefix token ids, key -> number): prefixes A and B hide the same keys with different numbers, on
    different stretches of the built-in held-out text."""
    from oscar_cli.data import heldout_text

    hay = tok(heldout_text(), add_special_tokens=False)["input_ids"]
    out = {}
    for name, offset, seed in (("A", 0, 11), ("B", 20_000, 29)):
        numbers = {k: str(1_000_000 + (seed * 7_919 * (i + 3)) % 9_000_000) for i, k in enumerate(KEYS)}
        needles = [tok(f" The special magic number for {k} is {numbers[k]}. ", add_special_tokens=False)["input_ids"]
                   for k in KEYS]
        filler = hay[offset: offset + PREFIX_TOKENS - sum(map(len, needles))]
        ids: list[int] = []
        cuts = [round(d * len(filler)) for d in DEPTHS]
        last = 0
        for cut, needle in zip(cuts, needles, strict=True):
            ids += filler[last:cut] + needle
            last = cut
        ids += filler[last:]
        out[name] = (ids, numbers)
    return out


def answer_tolerance() -> float:
    """Largest allowed |p_hit - p_cold| for an answer token both runs chose.

    A hit and its cold run read the same codes: the extend and decode kernels read every key beyond a query's recent
    window through its INT2 code whether it was written by this request or found in the radix cache (position-wise
    windows, ``kernels/oscar_kernels/extend.py``), so they differ only by bf16 rounding in another order. The scale to
    compare with is what INT2 itself does to a token: by Pinsker, the probability of a token moves by at most
    ``sqrt(2 KL)`` where ``KL`` is the per-token KL of the INT2 cache against exact attention, which the artifact
    measured at fit time (the summed sensitivity of its units at their allocated widths). Half of that: rounding in
    another order moved answer tokens by up to 0.033 on an H100 (the recipe's artifact, bound 0.079; a quarter,
    0.039, left too thin a margin), while a misread prefix (another request's pages, a lost sink or recent row)
    changes the answer itself, which the retrieval checks catch. Artifacts fitted without the sensitivity pass
    use 0.05."""
    from oscar_cli.artifact import load_artifact
    from oscar_cli.sensitivity import Sensitivity

    art = load_artifact(Path(ARTIFACT))
    d = art.manifest.metrics.get("sensitivity")
    if not d:
        return 0.05
    sens = Sensitivity.from_dict(d)
    s = art.manifest.scheme
    layers = sorted({i for i, _ in sens.kl})
    kl = sum(sens.predicted_kl(i, "k", s.bits_k[i] if s.bits_k else s.bits)
             + sens.predicted_kl(i, "v", s.bits_v[i] if s.bits_v else s.bits) for i in layers)
    return math.sqrt(2 * kl) / 2


def answer(out: dict) -> tuple[str, list[int], list[float]]:
    probs = [math.exp(lp) for lp, _tid, *_ in out["meta_info"]["output_token_logprobs"]]
    ids = [tid for _lp, tid, *_ in out["meta_info"]["output_token_logprobs"]]
    return out["text"], ids, probs


def test_prefix_hits_retrieve_what_cold_requests_retrieve(server, tok):
    prefixes = needle_prefixes(tok)
    asks = [(name, k, ids + tok(QUESTION.format(key=k), add_special_tokens=False)["input_ids"])
            for name, (ids, _numbers) in prefixes.items() for k in KEYS]
    cold = {}
    for name, k, ids in asks:
        flush(server)
        cold[(name, k)] = generate(server, ids)
        assert cold[(name, k)]["meta_info"]["cached_tokens"] == 0
    flush(server)
    misses = {}
    threads = [threading.Thread(target=lambda n=name, i=ids: misses.__setitem__(n, generate(server, i)))
               for name, k, ids in asks if k == KEYS[0]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hits: dict = {}
    threads = [threading.Thread(target=lambda n=name, k=k, i=ids: hits.__setitem__((n, k), generate(server, i)))
               for name, k, ids in asks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    tol = answer_tolerance()
    retrieved_cold, problems, worst = 0, [], 0.0
    for name, k, _ids in asks:
        number = prefixes[name][1][k]
        other = prefixes["B" if name == "A" else "A"][1][k]
        c_text, c_ids, c_p = answer(cold[(name, k)])
        h_text, h_ids, h_p = answer(hits[(name, k)])
        if hits[(name, k)]["meta_info"]["cached_tokens"] <= 0:
            problems.append(f"{name}/{k}: no prefix hit")
        if other in h_text:
            problems.append(f"{name}/{k}: the hit answered with prefix {'B' if name == 'A' else 'A'}'s number")
        if number in c_text:
            retrieved_cold += 1
            if number not in h_text:
                problems.append(f"{name}/{k}: retrieved cold ({c_text!r}), lost on the hit ({h_text!r})")
            if k == KEYS[0] and number not in misses[name]["text"]:
                problems.append(f"{name}/{k}: retrieved cold, lost on the miss")
        same = next((i for i, (a, b) in enumerate(zip(c_ids, h_ids, strict=False)) if a != b), len(c_ids))
        for i in range(same):
            worst = max(worst, abs(c_p[i] - h_p[i]))
            if abs(c_p[i] - h_p[i]) > tol:
                problems.append(f"{name}/{k} token {i}: p {h_p[i]:.4f} on the hit vs {c_p[i]:.4f} cold (> {tol:.4f})")
    print(f"needles retrieved cold {retrieved_cold}/{len(asks)}; worst abs(p_hit - p_cold) {worst:.4f} "
          f"(tolerance {tol:.4f})")
    assert retrieved_cold >= 3, f"only {retrieved_cold} needles retrieved cold: the check would prove nothing"
    assert not problems, "; ".join(problems)


# ---------------------------------------------------------------------------------------------------- bad input
def test_request_longer_than_the_context_is_refused_and_the_server_keeps_serving(server, tok):
    status, info = call(server, "/get_model_info")
    assert status == 200, info
    config = json.loads((Path(MODEL) / "config.json").read_text())
    context = int(config["max_position_embeddings"])
    status, out = call(server, "/generate", {"input_ids": [100] * (context + 64),
                                             "sampling_params": {"max_new_tokens": 4}})
    assert status == 400, (status, out)
    assert re.search(r"context length|longer than", json.dumps(out)), out
    assert call(server, "/health")[0] == 200
    ok = generate(server, tok("The capital of France is", add_special_tokens=False)["input_ids"])
    assert ok["meta_info"]["completion_tokens"] > 0


def _launch_fails(argv: list[str], env: dict, tmp_path: Path, want: str) -> None:
    log = tmp_path / "refused.log"
    with open(log, "w") as f:
        proc = subprocess.run(argv, env={**os.environ, **env}, cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT,
                              timeout=300)
    text = log.read_text(errors="replace")
    assert proc.returncode != 0, text[-2000:]
    assert want in text, text[-2000:]


def test_a_refused_flag_stops_the_launch_with_one_line(tmp_path):
    from oscar_cli.serve.sglang.launch import build_launch

    argv, env = build_launch(MODEL, Path(ARTIFACT), "127.0.0.1", 30177, [])
    _launch_fails([*argv, "--kv-cache-dtype", "fp8_e4m3"], env, tmp_path,
                  "oscar: --kv-cache-dtype fp8_e4m3: the OSCAR pool stores INT2 codes")


def test_an_edited_artifact_stops_the_launch_with_one_line(tmp_path):
    from oscar_cli.serve.sglang.launch import build_launch

    art = tmp_path / "edited"
    shutil.copytree(ARTIFACT, art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["scheme"]["recent"] = int(manifest["scheme"]["recent"]) + 1
    (art / "manifest.json").write_text(json.dumps(manifest))
    argv, env = build_launch(MODEL, art, "127.0.0.1", 30178, [])
    _launch_fails(argv, env, tmp_path, "content hash mismatch")


if __name__ == "__main__":  # pragma: no cover - run by hand on the GPU machine
    sys.exit(pytest.main([__file__, "-q"]))
