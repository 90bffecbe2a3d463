"""The SGLang plugin on a GPU: real SGLang 0.5.17 with ``--attention-backend oscar`` (run by ``sglang_h200.sh``).

Steps (each appends its table to ``benchmarks/RESULTS.md`` with date, device, commit and command):

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
* ``capacity``: ``max_total_num_tokens`` SGLang reports for a Qwen3-8B-shaped model (random weights,
  ``--load-format dummy``) with the OSCAR backend against triton BF16 at the same ``--mem-fraction-static``.

Usage (on the GPU machine, SGLang's site on PYTHONPATH, see ``sglang_h200.sh``)::

    python3 benchmarks/sglang_h200.py all --model MODEL_DIR --artifact ART_DIR --store STORE --work WORK [--commit C]

``engine`` is the helper subcommand that runs the transformers side in a process of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "RESULTS.md"
NEW_TOKENS = 96
PPL_SEQ_LEN, PPL_WINDOWS = 512, 4
"""Held-out perplexity windows (``oscar eval``'s ``oscar_ppl`` text): through each server's prompt logprobs and
through the project's own decode path."""
PREFIX_TOKENS = 2048
SHARING = 8
MEM_FRACTION = 0.85
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu", "attention_bias": False,
    "bos_token_id": 151643, "eos_token_id": 151645,
}
SERVER_FLAGS = ["--sampling-backend", "pytorch", "--cuda-graph-max-bs-decode", "16", "--log-level", "info"]


# ---------------------------------------------------------------------------------------------------- the server
class Server:
    """One SGLang HTTP server process; its log goes to ``log``."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, port: int):
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self._f = open(log, "w")
        self.proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=self._f, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.argv = argv

    def wait(self, timeout: float = 1200) -> None:
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SGLang exited with {self.proc.returncode}; last log lines:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(2)
        raise TimeoutError(f"SGLang did not answer /health in {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def call(self, path: str, payload: dict | None = None, timeout: float = 600) -> dict:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read().decode()
        return json.loads(body) if body.strip().startswith(("{", "[")) else {"text": body}

    def generate(self, ids: list[int], n: int = NEW_TOKENS) -> dict:
        return self.call("/generate", {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n,
                                                                             "ignore_eos": True}})

    def max_total_num_tokens(self) -> int:
        info = self.call("/server_info")
        found = _find_key(info, "max_total_num_tokens")
        if found is None:
            m = re.findall(r"max_total_num_tokens=(\d+)", self.log.read_text(errors="replace"))
            found = int(m[-1]) if m else None
        if found is None:
            raise RuntimeError("max_total_num_tokens neither in /server_info nor in the log")
        return int(found)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
        self._f.close()


def _find_key(obj, key):
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        obj = list(obj.values())
    if isinstance(obj, list):
        for v in obj:
            r = _find_key(v, key)
            if r is not None:
                return r
    return None


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
    srv = Server(argv, env, work / f"server-{backend}-{model.name}-{port}.log", port)
    try:
        srv.wait()
    except BaseException:
        srv.stop()
        raise
    return srv


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
    the same engine's cache (``oscar eval --decode``'s computation: ``oscar_cli.evaluate.perplexity``)."""
    import torch

    from oscar_cli.evaluate import perplexity, prepare
    from oscar_cli.serve.engine import SamplingParams, TransformersEngine

    eng = TransformersEngine.load(str(args.model), Path(args.store), Path(args.artifact) if args.artifact else None)
    eng.start()
    try:
        outs = [eng.generate(ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)).token_ids
                for ids in json.loads(Path(args.prompts).read_text())]
    finally:
        eng.stop()
    from oscar_cli.methods import get_method, scheme_for

    model = eng.loaded.model
    d = model.config.head_dim if getattr(model.config, "head_dim", None) else \
        model.config.hidden_size // model.config.num_attention_heads
    art = eng.artifact
    method = get_method("oscar" if art is not None else "bf16")
    scheme = scheme_for(method, d, artifact_scheme=art.scheme if art is not None else None)
    prep = prepare(model, method, scheme, art)
    windows = torch.tensor(json.loads(Path(args.prompts).with_name("ppl_windows.json").read_text()))
    ppl = perplexity(model, windows, prep, decode=True)
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
    from oscar_cli.evaluate import token_ids, windows_of

    windows = windows_of(token_ids(tok, heldout_text()), PPL_SEQ_LEN, PPL_WINDOWS)
    (work / "ppl_windows.json").write_text(json.dumps(windows.tolist()))
    return path, prompts, prefix, suffixes


# ---------------------------------------------------------------------------------------------------- steps
def prefix_protocol(srv: Server, reqs: list[list[int]]) -> dict:
    """The shared-prefix runs on one server: a warm-up request alone (caches the prefix), the requests together
    (all hit it), each alone again with the cache as it is (a hit, batch 1), and each alone after ``/flush_cache``
    (no hit, batch 1). Comparing the last two isolates prefix reuse from batching; together vs alone-uncached
    shows both, and the triton BF16 control shows what batching alone does to greedy bf16 outputs."""
    srv.call("/flush_cache", {})
    warm = srv.generate(reqs[0])
    together: list[dict | None] = [None] * len(reqs)

    def one(i):
        together[i] = srv.generate(reqs[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hit = [srv.generate(r) for r in reqs]
    cold = []
    for r in reqs:
        srv.call("/flush_cache", {})
        cold.append(srv.generate(r))
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

    from oscar_cli.evaluate import perplexity_via_server, server_info

    windows = torch.tensor(json.loads((work / "ppl_windows.json").read_text()))
    return perplexity_via_server(server_info(srv.url), windows)


def step_serve(args, work: Path) -> str:
    """Greedy outputs and the shared-prefix runs, one server start per backend (oscar, then the triton control)."""
    path, prompts, prefix, suffixes = make_prompts(args.model, work)
    reqs = [prefix + s for s in suffixes]
    got, runs, ppl = {}, {}, {}
    for backend, art in (("oscar", args.artifact), ("triton", None)):
        srv = start(backend, args.model, args.port, work, art)
        try:
            got[backend] = [srv.generate(p)["output_ids"] for p in prompts]
            runs[backend] = prefix_protocol(srv, reqs)
            ppl[backend] = server_perplexity(srv, work)
        finally:
            srv.stop()
    for name, art in (("oscar-cache", args.artifact), ("bf16", None)):
        res = engine_outputs(args.model, args.store, art, path, work / f"engine-{name}.json")
        got[name], ppl[name] = res["outputs"], res["ppl_decode"]
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


def qwen3_dummy(args, work: Path) -> tuple[Path, Path]:
    """A Qwen3-8B-shaped config (SmolLM2's tokenizer files) and a data-free per-head Hadamard artifact for it."""
    import shutil

    import torch
    from oscar_kernels.scheme import QuantScheme

    from oscar_cli.artifact import Manifest, write_artifact
    from oscar_cli.config import AttentionShape
    from oscar_cli.rotation import data_free_hadamard

    folder = work / "qwen3-8b-dummy"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(QWEN3_8B, indent=2))
    for f in Path(args.model).iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, folder / f.name)
    n, h, d = QWEN3_8B["num_hidden_layers"], QWEN3_8B["num_key_value_heads"], QWEN3_8B["head_dim"]
    r = data_free_hadamard(d, d).float().expand(n, h, d, d).contiguous()
    t = {"layers": torch.arange(n), "r_k": r, "r_v": r.clone(), "clip_k": torch.ones(n, h), "clip_v": torch.ones(n, h),
         "eig_k": torch.zeros(n, h, d), "eig_v": torch.zeros(n, h, d)}
    m = Manifest(model_slug="qwen3-8b-dummy", model_fingerprint="none (random weights)", run_id=None,
                 stats_digest="", data_digest="", calibration_tokens=0, method="hadamard", per_head=True,
                 layers=tuple(range(n)), shape=AttentionShape(n, QWEN3_8B["num_attention_heads"], h, d),
                 scheme=QuantScheme(group=d, sink=64, recent=256), fit_clip=False, clip_grid=(), metrics={})
    return folder, write_artifact(work / "artifacts", m, t, "")


def step_capacity(args, work: Path) -> str:
    folder, art = qwen3_dummy(args, work)
    extra = ["--load-format", "dummy", "--mem-fraction-static", str(MEM_FRACTION), "--context-length", "32768"]
    tokens = {}
    for backend, a in (("triton", None), ("oscar", art)):
        srv = start(backend, folder, args.port, work, a, extra)
        try:
            tokens[backend] = srv.max_total_num_tokens()
        finally:
            srv.stop()
    return (f"Qwen3-8B shapes (36 layers, 8 KV heads, d 128; random weights), --mem-fraction-static {MEM_FRACTION}, "
            f"--max-running-requests 64 (oscar: 64 anchors), scheme int2.g128.s64.r256:\n\n"
            "| backend | max_total_num_tokens |\n| --- | --- |\n"
            f"| triton (BF16) | {tokens['triton']} |\n| oscar | {tokens['oscar']} |\n\n"
            f"Ratio: {tokens['oscar'] / tokens['triton']:.2f}x.")


def device_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, check=True).stdout.strip().splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown device"


def append(title: str, body: str, args) -> None:
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    cmd = "python3 benchmarks/sglang_h200.py " + " ".join(sys.argv[1:])
    text = (f"\n## SGLang plugin, {title}: {date}, {device_name()}, commit {args.commit}\n\n"
            f"Command: `{cmd}` (SGLang 0.5.17, `benchmarks/sglang_h200.sh`).\n\n{body}\n")
    with open(RESULTS, "a") as f:
        f.write(text)
    print(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=["all", "serve", "capacity", "engine"])
    p.add_argument("--model", type=Path, required=True, help="converted model folder (with oscar_model.json)")
    p.add_argument("--artifact", type=Path, help="per-head artifact fitted for --model")
    p.add_argument("--store", type=Path, default=Path(".oscar"))
    p.add_argument("--work", type=Path, default=Path("/tmp/oscar-h200/work"))
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--commit", default=os.environ.get("OSCAR_COMMIT", "unknown"))
    p.add_argument("--prompts", type=Path)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.step == "engine":
        run_engine(args)
        return
    args.work.mkdir(parents=True, exist_ok=True)
    steps = {"serve": ("greedy outputs vs OscarCache and a shared 2k-token prefix", step_serve),
             "capacity": ("KV capacity at Qwen3-8B shapes", step_capacity)}
    for name in (steps if args.step == "all" else [args.step]):
        title, fn = steps[name]
        append(title, fn(args, args.work), args)


if __name__ == "__main__":
    main()
