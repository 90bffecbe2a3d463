"""The SGLang plugin on a GPU: real SGLang 0.5.17 with ``--attention-backend oscar`` (run by ``sglang_h200.sh``).

Steps (each appends its table to ``benchmarks/RESULTS.md`` with date, device, commit and command):

* ``ruler``: RULER and the needle grid (requests built by ``benchmarks/ruler_server.py prepare``) through one server
  per configuration: the artifact (``oscar``), each ``--extra-artifact NAME=DIR`` (e.g. uniform INT2, Hadamard INT2)
  and SGLang's own BF16 and FP8 caches (flashinfer). Greedy answers go to ``WORK/ruler-<config>.json`` with the bits
  per element the server's pool stores; ``ruler_server.py score`` scores them with lm-eval on the CPU. While the
  ``oscar`` server is up, ``tests/serve/test_sglang_server_live.py`` runs against it (prefix hits keep retrieval, a
  request longer than the context), and its launch-refusal tests after it stops.
* ``serve``: one server start per backend (oscar, then the triton BF16 control) for both of

  - greedy completions (96 tokens, EOS ignored) of several held-out prompts from SGLang with the OSCAR
  backend against the project's own path (``TransformersEngine``: transformers + ``OscarCache`` + the fused
  kernels) on the same model and artifact; as the control of what two engines' BF16 numerics alone do, SGLang with
  its triton backend against the same engine without an artifact. Reported: tokens until the first difference and
  the fraction of equal tokens, per prompt; and where bf16 rounding makes greedy outputs part, the perplexity of
  held-out windows through each server's prompt logprobs (``oscar eval --server``'s computation) against the same
  windows decoded token by token through the project's cache (``oscar eval --decode``'s);
  - a 2,048-token shared prefix (:func:`prefix_protocol`): one request alone warms it, then 8 requests sharing it
  run together (``cached_tokens`` must be > 0, the anchored prefix), each again alone on the warm cache (a hit at
  batch 1), and each alone after ``/flush_cache`` (``cached_tokens`` 0). Reported: cached tokens and where the
  completions first differ from the cold one; warm-alone vs cold isolates prefix reuse from batching, and the
  triton rows show what batching alone does to greedy bf16 outputs.

KV capacity at Qwen3-8B shapes (SGLang's ``max_total_num_tokens`` with the oscar backend against SGLang's own
caches at one ``--mem-fraction-static``) is ``oscar bench``'s server record (:mod:`oscar_cli.bench`).

Usage (on the GPU machine, SGLang's site on PYTHONPATH, see ``sglang_h200.sh``)::

    python3 benchmarks/sglang_h200.py serve --model MODEL_DIR --artifact ART_DIR --store STORE --work WORK [--commit C]

``engine`` is the helper subcommand that runs the transformers side in a process of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from oscar_cli.bench.server import Server, device_name, kv_allocation, oscar_budget
from oscar_cli.results_md import append_section

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "RESULTS.md"
NEW_TOKENS = 96
PPL_SEQ_LEN, PPL_WINDOWS = 512, 4
"""Held-out perplexity windows (``oscar eval``'s ``oscar_ppl`` text): through each server's prompt logprobs and
through the project's own decode path."""
PREFIX_TOKENS = 2048
SHARING = 8
SERVER_FLAGS = ["--sampling-backend", "pytorch", "--cuda-graph-max-bs-decode", "16", "--log-level", "info"]
START_TIMEOUT_S = 1200


# ---------------------------------------------------------------------------------------------------- the server
def start(backend: str, model: Path, port: int, work: Path, artifact: Path | None = None,
          extra: list[str] | None = None) -> Server:
    extra = [*SERVER_FLAGS, *(extra or [])]
    if backend == "oscar":
        from oscar_cli.serve.sglang.launch import build_launch

        argv, env = build_launch(str(model), artifact, "127.0.0.1", port, extra)
    else:
        argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
                "--port", str(port), "--attention-backend", backend, *extra]
        env = {}
    srv = Server(argv, env, work / f"server-{backend}-{model.name}-{port}.log", port, cwd=work)
    try:
        srv.wait_ready(START_TIMEOUT_S)
    except BaseException:
        srv.stop()
        raise
    return srv


def generate(srv: Server, ids: list[int], n: int = NEW_TOKENS) -> dict:
    """Greedy ``/generate`` of ``n`` tokens (EOS ignored)."""
    return srv.post("/generate", {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n,
                                                                        "ignore_eos": True}}, timeout=600)


# ---------------------------------------------------------------------------------------------------- helpers
def agreement(a: list[int], b: list[int]) -> tuple[int, float]:
    """(tokens before the first difference, fraction of equal positions)."""
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    same = sum(x == y for x, y in zip(a, b, strict=False)) / max(len(a), len(b), 1)
    return first, same


def engine_outputs(model: Path, store: Path, artifact: Path | None, prompts: Path, out: Path) -> dict:
    """Greedy completions (``outputs``) and decode perplexity (``ppl_decode``) from the project's transformers
    engine, in a process of its own (the image's transformers, not SGLang's)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.environ.get("OSCAR_SITE", "")
    cmd = [sys.executable, __file__, "engine", "--model", str(model), "--store", str(store), "--prompts",
           str(prompts), "--out", str(out)] + (["--artifact", str(artifact)] if artifact else [])
    subprocess.run(cmd, check=True, env=env)
    return json.loads(out.read_text())


def run_engine(args) -> None:
    """Greedy completions of the prompts, then the perplexity of the held-out windows decoded token by token through
    the same engine's cache (``oscar eval --decode``'s computation: ``oscar_cli.eval.perplexity.perplexity``)."""
    import torch

    from oscar_cli.eval.perplexity import perplexity
    from oscar_cli.serve.engine import SamplingParams, TransformersEngine

    eng = TransformersEngine.load(str(args.model), Path(args.store), Path(args.artifact) if args.artifact else None)
    eng.start()
    try:
        outs = [eng.generate(ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)).token_ids
                for ids in json.loads(Path(args.prompts).read_text())]
    finally:
        eng.stop()
    windows = torch.tensor(json.loads(Path(args.prompts).with_name("ppl_windows.json").read_text()))
    ppl = perplexity(eng.model, windows, eng.kv.prepared, decode=True)
    Path(args.out).write_text(json.dumps({"outputs": outs, "ppl_decode": ppl}))


def make_prompts(model: Path, work: Path) -> tuple[Path, list[list[int]], list[int], list[list[int]]]:
    """Held-out prompts (pydoc topics), the 2k-token shared prefix and 8 suffixes, as token ids of ``model``."""
    from pydoc_data.topics import topics

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    texts = [topics[k] for k in sorted(topics)]
    prompts = [tok(t, add_special_tokens=False)["input_ids"][:n] for t, n in zip(texts[-4:], (64, 200, 500, 1000),
                                                                                      strict=True)]
    long_ids = tok("\n\n".join(texts), add_special_tokens=False)["input_ids"]
    prefix = long_ids[:PREFIX_TOKENS]
    suffixes = [tok(texts[i], add_special_tokens=False)["input_ids"][:48] for i in range(SHARING)]
    path = work / "prompts.json"
    path.write_text(json.dumps(prompts))
    from oscar_cli.data import heldout_text
    from oscar_cli.eval.segments import segments_of, token_ids

    windows = segments_of(token_ids(tok, heldout_text()), PPL_SEQ_LEN, PPL_WINDOWS)
    (work / "ppl_windows.json").write_text(json.dumps(windows.tolist()))
    return path, prompts, prefix, suffixes


# ---------------------------------------------------------------------------------------------------- steps
def prefix_protocol(srv: Server, reqs: list[list[int]]) -> dict:
    """The shared-prefix runs on one server: a warm-up request alone (caches the prefix), the requests together
    (all hit it), each alone again with the cache as it is (a hit, batch 1), and each alone after ``/flush_cache``
    (no hit, batch 1). Comparing the last two isolates prefix reuse from batching; together vs alone-uncached
    shows both, and the triton BF16 control shows what batching alone does to greedy bf16 outputs."""
    srv.post("/flush_cache")
    warm = generate(srv, reqs[0])
    together: list[dict | None] = [None] * len(reqs)

    def one(i):
        together[i] = generate(srv, reqs[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hit = [generate(srv, r) for r in reqs]
    cold = []
    for r in reqs:
        srv.post("/flush_cache")
        cold.append(generate(srv, r))
    return dict(warm=warm, together=together, hit=hit, cold=cold)


def prefix_rows(backend: str, runs: dict, reqs: list[list[int]]) -> list[str]:
    cached = lambda r: r["meta_info"]["cached_tokens"]  # noqa: E731
    rows = []
    for i, r in enumerate(reqs):
        tog = agreement(runs["together"][i]["output_ids"], runs["cold"][i]["output_ids"])
        hit = agreement(runs["hit"][i]["output_ids"], runs["cold"][i]["output_ids"])
        rows.append(f"| {backend} | {i} | {len(r)} | {cached(runs['together'][i])} | {tog[0]} / {tog[1]:.0%} | "
                    f"{cached(runs['hit'][i])} | {hit[0]} / {hit[1]:.0%} | {cached(runs['cold'][i])} |")
    return rows


def server_perplexity(srv: Server, work: Path) -> float:
    """``oscar eval --server``'s perplexity (prompt logprobs) of the held-out windows, against this server."""
    import torch

    from oscar_cli.eval.remote import perplexity_via_server, server_info

    windows = torch.tensor(json.loads((work / "ppl_windows.json").read_text()))
    return perplexity_via_server(server_info(srv.url), windows)


def step_serve(args, work: Path) -> str:
    """Greedy outputs and the shared-prefix runs, one server start per backend (oscar, then the triton control),
    while the project's engine runs with and then without the artifact in a thread of its own (its own process; both
    sides measure outputs, not speed, and the tiny model leaves the GPU mostly idle). Every result is saved in
    ``WORK/serve.json`` as soon as it exists, and a re-run of the step (same ``--work``) skips what is there: a step
    cut short by its time limit keeps what it measured and the next run finishes it. An engine failure is raised
    once the servers are done."""
    state_path = work / "serve.json"
    state = json.loads(state_path.read_text()) if state_path.is_file() else {}

    lock = threading.Lock()

    def keep(key, fn, *fn_args):
        if key not in state:
            value = fn(*fn_args)
            with lock:
                state[key] = value
                tmp = state_path.with_suffix(".tmp")
                tmp.write_text(json.dumps(state))
                tmp.replace(state_path)
        return state[key]

    path, prompts, prefix, suffixes = make_prompts(args.model, work)
    reqs = [prefix + s for s in suffixes]
    engine_error: list[BaseException] = []

    def engines():
        try:
            for name, art in (("oscar-cache", args.artifact), ("bf16", None)):
                keep(f"{name}/engine", engine_outputs, args.model, args.store, art, path, work / f"engine-{name}.json")
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread below
            engine_error.append(e)

    engine_thread = threading.Thread(target=engines, daemon=True)
    engine_thread.start()
    for backend, art in (("oscar", args.artifact), ("triton", None)):
        if all(f"{backend}/{k}" in state for k in ("outputs", "prefix", "ppl")):
            continue
        srv = start(backend, args.model, args.port, work, art)
        try:
            keep(f"{backend}/outputs", lambda s: [generate(s, p)["output_ids"] for p in prompts], srv)
            keep(f"{backend}/prefix", prefix_protocol, srv, reqs)
            keep(f"{backend}/ppl", server_perplexity, srv, work)
        finally:
            srv.stop()
    engine_thread.join()
    if engine_error:
        raise engine_error[0]
    got = {b: state[f"{b}/outputs"] for b in ("oscar", "triton")}
    got.update({n: state[f"{n}/engine"]["outputs"] for n in ("oscar-cache", "bf16")})
    ppl = {b: state[f"{b}/ppl"] for b in ("oscar", "triton")}
    ppl.update({n: state[f"{n}/engine"]["ppl_decode"] for n in ("oscar-cache", "bf16")})
    runs = {b: state[f"{b}/prefix"] for b in ("oscar", "triton")}
    rows = [f"Greedy completions of {NEW_TOKENS} tokens (EOS ignored) of held-out prompts: SGLang with the oscar "
            "backend against the project's transformers path with OscarCache (same model and artifact), and as the "
            "control SGLang's triton BF16 backend against transformers BF16.", "",
            "| prompt tokens | SGLang oscar vs OscarCache: first diff / equal | SGLang triton vs transformers bf16 |",
            "| --- | --- | --- |"]
    for i, p in enumerate(prompts):
        a = agreement(got["oscar"][i], got["oscar-cache"][i])
        b = agreement(got["triton"][i], got["bf16"][i])
        rows.append(f"| {len(p)} | {a[0]} / {a[1]:.0%} | {b[0]} / {b[1]:.0%} |")
    rows += ["", f"Perplexity of {PPL_WINDOWS} held-out windows of {PPL_SEQ_LEN} tokens: through each SGLang "
             "server's prompt logprobs, and decoded token by token through the project's cache "
             "(`oscar eval --decode`'s computation).", "",
             "| | SGLang server logprobs | project decode path | server / project |", "| --- | --- | --- | --- |",
             f"| oscar (artifact) | {ppl['oscar']:.4f} | {ppl['oscar-cache']:.4f} | "
             f"{ppl['oscar'] / ppl['oscar-cache']:.4f} |",
             f"| bf16 (triton / transformers) | {ppl['triton']:.4f} | {ppl['bf16']:.4f} | "
             f"{ppl['triton'] / ppl['bf16']:.4f} |"]
    rows += ["", f"Shared {PREFIX_TOKENS}-token prefix, {SHARING} requests (prefix + a distinct 48-token suffix). "
             "Each request's completion is compared with the same request alone on a flushed cache (cold): run "
             "together (batch 8, prefix hit) and alone on the warm cache (batch 1, hit).", "",
             "| backend | request | prompt | cached together | together vs cold: first diff / equal | cached alone "
             "(warm) | warm alone vs cold: first diff / equal | cached cold |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for backend in runs:
        rows += prefix_rows(backend, runs[backend], reqs)
    ok = all(t["meta_info"]["cached_tokens"] > 0 for t in runs["oscar"]["together"])
    rows += ["", f"All {SHARING} shared oscar requests reused the prefix: {'yes' if ok else 'NO'}."]
    return "\n".join(rows)


RULER_BASELINES = (("bf16", "flashinfer", []), ("fp8", "flashinfer", ["--kv-cache-dtype", "fp8_e4m3"]))
"""SGLang's own caches in the RULER table: (name, attention backend, extra flags)."""
RULER_CLIENTS = 64
LIVE_TESTS = REPO / "tests" / "serve" / "test_sglang_server_live.py"


def pool_bits(log: str, model: Path) -> float | None:
    """Bits per cached K/V element the server's pool stores: the plugin's budget line (bytes per token), else
    SGLang's KV allocation line (bytes over tokens)."""
    cfg = json.loads((model / "config.json").read_text())
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    elements = cfg["num_hidden_layers"] * 2 * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * d
    if (b := oscar_budget(log)) is not None:
        return b["cell_bytes"] * 8 / elements
    if (a := kv_allocation(log)) is not None:
        return (a["k_gib"] + a["v_gib"]) * 2**30 * 8 / (a["tokens"] * elements)
    return None


def live_tests(args, work: Path, url: str | None, select: str) -> dict:
    """``tests/serve/test_sglang_server_live.py`` (``-k select``) against ``url``; rc and the summary line."""
    env = {**os.environ, "OSCAR_LIVE_MODEL": str(args.model), "OSCAR_LIVE_ARTIFACT": str(args.artifact)}
    if url:
        env["OSCAR_LIVE_URL"] = url
    log = work / f"server_live-{select.split()[0]}.log"
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", str(LIVE_TESTS),
                             "-k", select], env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    return {"rc": rc, "summary": lines[-1] if lines else "", "lines": [x for x in lines if "needles" in x][-1:]}


def step_ruler(args, work: Path) -> str:
    """One server per configuration answers every RULER/grid request (greedy, EOS stops); each configuration's
    answers are saved as soon as they exist, so a re-run finishes what a cut-short one left."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from ruler_server import load_requests

    reqs = load_requests(args.ruler)["requests"]
    configs = [("oscar", "oscar", args.artifact, [])]
    configs += [(name, "oscar", Path(path), []) for name, path in (x.split("=", 1) for x in args.extra_artifact)]
    configs += [(name, backend, None, extra) for name, backend, extra in RULER_BASELINES]
    done = []
    for i, (name, backend, art, extra) in enumerate(configs):
        out = work / f"ruler-{name}.json"
        if out.is_file():
            done.append(json.loads(out.read_text()))
            continue
        srv = start(backend, args.model, args.port + i, work, art, extra)
        errors: list[str] = []
        try:
            t0 = time.perf_counter()

            def ask(r, srv=srv, errors=errors):
                try:
                    got = srv.post("/generate", {"input_ids": r["ids"], "sampling_params": {
                        "temperature": 0, "max_new_tokens": r["max_new_tokens"]}}, timeout=900)
                    return str(r["id"]), got["text"]
                except Exception as e:  # noqa: BLE001 - counted and reported; the answer scores 0
                    errors.append(f"{r['id']}: {e}"[:200])
                    return str(r["id"]), ""

            with ThreadPoolExecutor(RULER_CLIENTS) as pool:
                answers = dict(pool.map(ask, reqs))
            record = {"config": name, "backend": backend, "artifact": str(art) if art else None,
                      "device": device_name(), "commit": args.commit, "start_s": srv.start_s,
                      "answer_s": time.perf_counter() - t0, "bits_per_element": pool_bits(srv.log_text(), args.model),
                      "errors": errors, "answers": answers}
            if name == "oscar":
                record["live"] = live_tests(args, work, srv.url, "retrieve or longer")
        finally:
            srv.stop()
        if name == "oscar":
            record["live_refusals"] = live_tests(args, work, None, "stops_the_launch")
        out.write_text(json.dumps(record))
        done.append(record)
    rows = ["| configuration | server start s | answering s | failed requests | bits/element | live tests |",
            "| --- | --- | --- | --- | --- | --- |"]
    for r in done:
        live = "; ".join(f"{x['summary']} {' '.join(x['lines'])}".strip() for x in (r.get("live"), r.get("live_refusals")) if x)
        rows.append(f"| {r['config']} | {r['start_s'] or 0:.0f} | {r['answer_s']:.0f} | {len(r['errors'])} | "
                    f"{r['bits_per_element'] or float('nan'):.3f} | {live or '-'} |")
    return (f"{len(reqs)} RULER/needle-grid requests per configuration ({RULER_CLIENTS} clients; scores: "
            "`benchmarks/ruler_server.py score`).\n\n" + "\n".join(rows))


def append(title: str, body: str, args) -> None:
    text = append_section(RESULTS, f"SGLang plugin, {title}", device_name(), args.commit,
                          "SGLang 0.5.17 (`benchmarks/sglang_h200.sh`).", body,
                          command=["benchmarks/sglang_h200.py", *sys.argv[1:]])
    print(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=["serve", "ruler", "engine"])
    p.add_argument("--model", type=Path, required=True, help="converted model folder (with oscar_model.json)")
    p.add_argument("--artifact", type=Path, help="per-head artifact fitted for --model")
    p.add_argument("--store", type=Path, default=Path(".oscar"))
    p.add_argument("--work", type=Path, default=Path("/tmp/oscar-h200/work"))
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--commit", default=os.environ.get("OSCAR_COMMIT", "unknown"))
    p.add_argument("--prompts", type=Path)
    p.add_argument("--out", type=Path)
    p.add_argument("--ruler", type=Path, help="requests of `ruler_server.py prepare` (step ruler)")
    p.add_argument("--extra-artifact", action="append", default=[], metavar="NAME=DIR",
                   help="another artifact served in the ruler step under NAME")
    args = p.parse_args()
    if args.step == "engine":
        run_engine(args)
        return
    args.work.mkdir(parents=True, exist_ok=True)
    if args.step == "ruler":
        append("RULER and needle-grid answers, prefix-hit retrieval and refusals", step_ruler(args, args.work), args)
        return
    append("greedy outputs vs OscarCache and a shared 2k-token prefix", step_serve(args, args.work), args)


if __name__ == "__main__":
    main()
