"""``oscar bench``: capacity, decode throughput and latency of OSCAR INT2 KV in SGLang 0.5.17 against SGLang's own
BF16 and FP8 KV caches, end to end through the HTTP server (the driver behind ``oscar_cli/cli/bench.py``).

NOT RUN YET: this driver has not run on a GPU. Everything below is what it measures *when it runs*; its parsing,
records and rendering are tested on CPU over recorded sample data (``tests/test_cli_bench.py``), which is synthetic.

**Model.** A Qwen3-8B-shaped model: 36 layers, hidden 4096, 32 query / 8 KV heads, head dim 128, intermediate
12288, vocab 151936, RoPE theta 1e6, 131072 positions (:data:`QWEN3_8B_SHAPED`, written by :func:`write_model`),
served with ``--load-format dummy`` (random weights: decode speed does not depend on weight values) and a tokenizer
folder copied in (SmolLM2's, from ``oscar collect``'s converted model, is enough: prompts are random token ids below
its vocabulary). The oscar configuration needs an artifact of that shape: :func:`write_random_artifact` writes a
data-free one through :func:`oscar_cli.artifact.write_artifact` (a seeded Haar-random orthogonal rotation per layer
for K and one for V, shared by the KV heads, clip 1.0, ``QuantScheme`` defaults: INT2, group 128, sink 64, recent
256). The model folder carries ``oscar_model.json`` with a fingerprint of its config and "random weights", the same
fingerprint the manifest records, so the plugin's own check (``refusals.model_refusals``) compares them and notes
that ``--load-format dummy`` serves random weights. :func:`check_with_plugin` runs that check and the plugin's
budget (``setup.rank_setup``) before any server starts.

**Configurations** (:data:`CONFIGS`), each one server, all at one ``--mem-fraction-static`` (0.85),
``--context-length 131072``, ``--sampling-backend pytorch``, ``--load-format dummy``:
``oscar`` (``--attention-backend oscar --radix-cache-backend oscar`` through ``oscar_cli.serve.sglang.launch.
build_launch``, ``--max-running-requests 64``), ``flashinfer`` (BF16, the baseline of every ratio),
``flashinfer-fp8`` (``--kv-cache-dtype fp8_e4m3``), and on request ``triton`` / ``triton-fp8``. Baseline servers
run with ``SGLANG_PLUGINS=none`` (no plugin loaded: unmodified SGLang). Configurations run in that order
(baselines first), so the BF16 batch is known when oscar runs.

**What is measured** (``--measure``; each selectable, each written to ``OUT/results.jsonl`` as soon as it ends):

* ``server`` (always, free): SGLang's own ``max_total_num_tokens`` (``/server_info``, from the scheduler's init info;
  the start log's ``max_total_num_tokens=`` line as fallback), turned into concurrent 100k-token requests
  (``max_total_num_tokens // 100000``); the KV allocation SGLang logs (``KV Cache is allocated. dtype, #tokens,
  K size, V size``) and reports (``internal_states[0].memory_usage``: weights, kvcache, graphs, in GiB); for oscar
  the plugin's budget line (``OSCAR pool: N B/token ...; fixed F MiB = ...``). Bits per KV element: per token slot
  (``8 * cell bytes / (layers * 2 * KV heads * head dim)``) and over the pool's real allocation (``8 * kvcache bytes
  / (max_total_num_tokens * elements per token)``: for oscar this includes the exact sink/recent regions of every
  request slot and anchor, not the plan workspaces).
* ``capacity`` (admission): the N concurrent 100k-token requests the pool holds, started at once at a context whose
  prefill fits a ten-minute run (``--admission-context``, 32k: N x 32k tokens, labelled "N x 32k", i.e. 32% of the
  tokens N x 100k would hold), ``--admission-new-tokens`` each; read from the server: the largest
  ``num_running_reqs`` of ``/v1/loads`` (published by the scheduler at every prefill and every 15 decode steps)
  and the largest ``#running-req`` of its ``Decode batch`` log lines, with the token usage there.
* ``throughput``: decode tokens/s through the server's scheduler (streamed ``/generate`` requests, ``ignore_eos``)
  at the configuration's largest batch under its budget (the 100k count, capped by its max running requests) and at
  the equal batch (the BF16 largest batch, or ``--equal-batch``), each request at a 100k context. Client side: the
  tokens all streams received between the moment the last stream got its first token and the moment the first one
  finished, over that window; server side: the median ``gen throughput (token/s)`` of its ``Decode batch`` lines at
  that batch (first line dropped). How the cache is filled (``--fill``): ``prefill`` sends B distinct random
  prompts (B x L tokens of real prefill); ``prefix`` prefills one shared (L - decode - 32)-token prefix once and
  sends B requests of that prefix plus a distinct 32-token suffix (``cached_tokens`` checked on a probe first), so
  every step still attends over B x L positions but the pool holds one prefix (and the B streams read the same
  prefix slots, which L2 may serve more than once: an optimistic fill); ``auto`` (default) prefills when
  B x L <= ``--prefill-budget`` tokens (400k) and reuses the prefix otherwise. Every row says which.
* ``latency``: batch-1 inter-token latency (median of streamed token gaps) and time to first token at 8k, 32k and
  100k contexts (``--latency-contexts``), each prompt really prefilled.
* ``profile`` (``--profile``): oscar and BF16 only; SGLang's own ``/start_profile`` (torch profiler, GPU activity,
  ``num_steps`` decode steps, traces under ``SGLANG_TORCH_PROFILER_DIR`` = ``OUT/profiles``) during a decode at
  bs1/100k and at the largest batch (prefix fill); kernel time per step summarised as attention (attention, KV
  write and plan kernels of each backend), GEMM (the weight matmuls) and other.
* Peak GPU memory (``nvidia-smi``, polled every second) for every measurement, and the KV tokens in use
  (``/v1/loads``) to draw memory against batch and context.

**Budget.** The H200 allows 10 minutes per command and 30 per session: every configuration and measurement is
selectable, records are appended (and fsynced) one per line as each measurement ends, a measurement that cannot
start inside ``--budget-s`` is recorded as skipped, each request's timeout is a ceiling from its token counts
(:data:`PREFILL_FLOOR_TOK_S`, :data:`STEP_CEIL_S_PER_TOKEN`) capped by the time left, and timed-out requests are
aborted (``/abort_request``) and recorded as such. A first server start times out at ``--start-timeout`` (300 s; one
was 139 s there), later ones in the same command at :data:`RESTART_TIMEOUT_S` (180 s; 55 s there).

**Rendering** (pure functions over the records: :func:`summary_rows`, :func:`profile_rows`, :func:`markdown`,
:func:`results_section`, :func:`plot`): one table (capacity, ratios to BF16, requests per 100k, bits per element,
admission, tokens/s at the largest and the equal batch with ratios, ITL at each context, peak memory), the profile
summary, and a ``benchmarks/RESULTS.md`` section with date, device, commit and command taken from the records.

**On the H200** (not run yet). CPU side, once: SGLang's site archive and a tokenizer folder into the ignored
``.whl/`` (``/work/shared/sglang-h200/README.md``)::

    grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
    bash ../shared/sglang-h200/build_site.sh .whl/sgl && cp ../shared/sglang-h200/unpack.sh .whl/sgl/
    mkdir -p .whl/bench/tokenizer && cp STORE/models/smollm2-135m/tokenizer*.json .whl/bench/tokenizer/

GPU side, one configuration per 10-minute command, carrying ``.whl/sgl`` and ``.whl/bench`` (57 MiB with the
checkout); ``.whl/bench/results.jsonl`` carries the records of the calls before (the BF16 batch for oscar's equal
batch), copied back from ``$OUT`` after each call::

    . .whl/sgl/unpack.sh .whl/sgl/sglsite.tar.xz && mkdir -p /tmp/oscar-bench &&
    { cp .whl/bench/results.jsonl /tmp/oscar-bench/ 2>/dev/null; true; } &&
    python3 benchmarks/bench_e2e.py --configs flashinfer --tokenizer .whl/bench/tokenizer --out /tmp/oscar-bench;
    cp /tmp/oscar-bench/results.jsonl benchmarks/RESULTS.md $OUT/; cp /tmp/oscar-bench/logs/*.log $OUT/

then ``--configs oscar``, ``--configs flashinfer-fp8``, and ``--configs flashinfer,oscar --measure profile``; a
measurement that does not fit a command is recorded as skipped and can run alone (``--measure latency``). Back on
CPU, ``oscar bench --render .whl/bench/results.jsonl --results-md benchmarks/RESULTS.md --plot FILE`` (or the last
call's RESULTS.md, which holds one section over every record). ``python3 benchmarks/bench_e2e.py ARGS`` is ``oscar
bench ARGS`` for a checkout without installed entry points: it puts the checkout's ``oscar_cli`` and ``kernels`` (as
``oscar_kernels``) with the plugin's entry point on the path (:func:`plugin_site`), for the servers too.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import http.client
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SGLANG_VERSION = "0.5.17"
RESULTS_FILE = "results.jsonl"

# ---------------------------------------------------------------------------------------------------- the model
MODEL_SLUG = "qwen3-8b-shaped"
QWEN3_8B_SHAPED: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu", "attention_bias": False,
    "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 36,
    "initializer_range": 0.02, "bos_token_id": 151643, "eos_token_id": 151645,
}
"""Qwen3-8B's architecture (its config.json, with 131072 positions so ``--context-length 131072`` needs no
override)."""
ELEMENTS_PER_TOKEN = (2 * QWEN3_8B_SHAPED["num_hidden_layers"] * QWEN3_8B_SHAPED["num_key_value_heads"]
                      * QWEN3_8B_SHAPED["head_dim"])
"""K and V elements one token slot holds over all layers (73,728)."""
ROTATION_SEED = 0
"""Seed of the data-free artifact's rotations (the same artifact on every machine)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "tokenizer.model")
FIRST_TOKEN_ID = 100
"""Random prompt ids start here (above SmolLM2's special tokens)."""


class BenchError(Exception):
    """A benchmark that cannot run as asked (one line: what and how to fix it)."""


# ---------------------------------------------------------------------------------------------------- configurations
@dataclass(frozen=True)
class ServeConfig:
    """One SGLang server configuration under test."""

    name: str
    backend: str
    kv_dtype: str | None
    """``--kv-cache-dtype`` (None: SGLang's ``auto``, BF16 for this model)."""
    kv: str
    """How the table names its KV cache."""


CONFIGS: dict[str, ServeConfig] = {c.name: c for c in (
    ServeConfig("flashinfer", "flashinfer", None, "BF16"),
    ServeConfig("flashinfer-fp8", "flashinfer", "fp8_e4m3", "FP8 e4m3"),
    ServeConfig("triton", "triton", None, "BF16"),
    ServeConfig("triton-fp8", "triton", "fp8_e4m3", "FP8 e4m3"),
    ServeConfig("oscar", "oscar", None, "INT2 g128 s64/r256"),
)}
"""In run order: baselines first, so the BF16 largest batch is recorded before oscar needs it."""
BASELINE = "flashinfer"
"""The configuration every ratio is taken against (the fastest BF16 backend there: bs1/100k 9.4 vs 49.5 ms/token
with triton)."""
DEFAULT_CONFIGS = ("flashinfer", "flashinfer-fp8", "oscar")
MEASURES = ("capacity", "throughput", "latency", "profile")
DEFAULT_MEASURES = ("capacity", "throughput", "latency")
RUN_ORDER = ("capacity", "throughput", "profile", "latency")
"""The order measurements run in: the profile reuses the throughput's shared prefix before latency flushes it."""
PROFILED = ("oscar", "flashinfer", "triton")
"""Configurations ``profile`` runs for: oscar against BF16."""
FILLS = ("auto", "prefill", "prefix")

COMMON_FLAGS = ("--load-format", "dummy", "--sampling-backend", "pytorch", "--log-level", "info",
                "--decode-log-interval", "10")
"""Flags of every server. ``--decode-log-interval 10``: a ``Decode batch`` log line (gen throughput) every 10 steps
instead of 40, so a 128-step decode gives a dozen server-side samples."""
NO_PLUGINS = "none"
"""``SGLANG_PLUGINS`` of the baseline servers: a name no plugin has, so SGLang loads none."""

# Timeouts and budgets: ceilings, not estimates; every one is also capped by the time left in --budget-s.
PREFILL_FLOOR_TOK_S = 2000.0
"""Prefill rate below which a request counts as stuck (an 8B model prefills far faster on an H200)."""
STEP_CEIL_S_PER_TOKEN = 1e-6
"""Decode-step ceiling per token of context in the batch (twice the triton backend's bs1/100k rate there)."""
STEP_CEIL_S = 0.05
"""Decode-step ceiling at no context (launches, sampling)."""
REQUEST_SLACK_S = 60.0
"""Added to every request's ceiling (queueing, detokenizer, HTTP)."""
MIN_MEASURE_S = 30.0
"""A measurement does not start with less time than this left."""
POLL_S = 1.0
"""How often /v1/loads and nvidia-smi are polled during a measurement."""
RESTART_TIMEOUT_S = 180.0
"""Start timeout of every server after the first in one command (compile caches warm: 55 s there, plus up to a
minute of flashinfer JIT for a new backend); the first gets ``--start-timeout`` (300 s: 139 s seen, plus JIT)."""
HEALTH_POLL_S = 2.0
"""How often a starting server's /health is asked."""
SUFFIX_TOKENS = 32
"""Distinct tokens after the shared prefix of a ``prefix`` fill."""
PREFIX_SLACK = 2048
"""A probe counts the prefix as reused when ``cached_tokens`` is within this of its length: oscar reuses a prefix
up to an anchor, taken every 1024 positions (the plugin's default ``anchor_interval``) and at chunk ends."""
PROFILE_STEPS = 5
"""Decode steps one profile captures (SGLang's ``num_steps``)."""
PROFILE_TIMEOUT_S = 180.0
"""How long the trace export may take."""
GPU_FREE_MIB = 4096
"""After a server stops, the next one starts once the device uses less than this (or after 60 s)."""


@dataclass(frozen=True)
class BenchConfig:
    """One ``oscar bench`` run (see the module docstring for each measurement)."""

    out: Path
    tokenizer: Path | None = None
    configs: tuple[str, ...] = DEFAULT_CONFIGS
    measures: tuple[str, ...] = DEFAULT_MEASURES
    mem_fraction: float = 0.85
    context_length: int = 131072
    long_context: int = 100_000
    """The context of a "100k-token request": the capacity count, throughput and profile batches."""
    admission_context: int = 32768
    admission_new_tokens: int = 32
    latency_contexts: tuple[int, ...] = (8192, 32768, 100_000)
    decode_tokens: int = 128
    equal_batch: int | None = None
    fill: str = "auto"
    prefill_budget: int = 400_000
    max_running_requests: int = 64
    """oscar's request slots (each holds sink + recent exact rows per layer); the baselines keep SGLang's default."""
    cuda_graph_max_bs: int = 64
    budget_s: float = 540.0
    start_timeout_s: float = 300.0
    port: int = 31000
    extra: tuple[str, ...] = ()
    """Passed to every server after the bench's own flags."""
    command: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "out", Path(self.out))
        bad = [c for c in self.configs if c not in CONFIGS]
        if bad or not self.configs:
            raise BenchError(f"unknown configuration(s) {', '.join(bad) or '(none)'}; choose from {', '.join(CONFIGS)}")
        bad = [m for m in self.measures if m not in MEASURES]
        if bad:
            raise BenchError(f"unknown measurement(s) {', '.join(bad)}; choose from {', '.join(MEASURES)}")
        if self.fill not in FILLS:
            raise BenchError(f"--fill {self.fill}: choose from {', '.join(FILLS)}")
        if not 0 < self.mem_fraction < 1:
            raise BenchError(f"--mem-fraction-static {self.mem_fraction} must lie between 0 and 1")
        lengths = (self.long_context, self.admission_context, *self.latency_contexts)
        if any(c <= self.decode_tokens + SUFFIX_TOKENS or c > self.context_length for c in lengths):
            raise BenchError(f"every context ({', '.join(map(str, lengths))}) must exceed --decode-tokens + "
                             f"{SUFFIX_TOKENS} and fit --context-length {self.context_length}")
        object.__setattr__(self, "configs", tuple(c for c in CONFIGS if c in self.configs))
        object.__setattr__(self, "measures", tuple(m for m in RUN_ORDER if m in self.measures))


def parse_names(spec: str, allowed: Iterable[str], what: str) -> tuple[str, ...]:
    """Comma-separated names of ``allowed``; ValueError with one line otherwise."""
    allowed = tuple(allowed)
    names = tuple(t.strip() for t in spec.split(",") if t.strip())
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise ValueError(f"unknown {what} {', '.join(bad) or repr(spec)}; choose from {', '.join(allowed)}")
    return names


def requests_at(tokens: int | None, context: int) -> int | None:
    """Concurrent requests of ``context`` tokens a pool of ``tokens`` token slots holds."""
    return None if tokens is None else int(tokens) // int(context)


# ---------------------------------------------------------------------------------------------------- records
def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Recorder:
    """``OUT/results.jsonl``: one JSON record per line, appended and fsynced as each measurement ends, so a killed
    run keeps everything it finished. Every record carries ``measure``, ``config``, ``time``, ``device``,
    ``commit`` and ``command``."""

    def __init__(self, path: Path, device: str, commit: str, command: str):
        self.path = Path(path)
        self.meta = {"device": device, "commit": commit, "command": command}
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, measure: str, config: str, **values: Any) -> dict:
        rec = {"measure": measure, "config": config, "time": utc_now(), **self.meta, **values}
        line = json.dumps(rec, sort_keys=True, default=str)
        with open(self.path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        return rec


def load_records(path: Path) -> list[dict]:
    """Records of a results file: JSON lines (a truncated last line is dropped), a JSON list, or ``{"records":
    [...]}``."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise BenchError(f"cannot read {path} ({e.strerror}); pass the results.jsonl an oscar bench run wrote") from None
    stripped = text.lstrip()
    if stripped.startswith("["):
        return _records_of(json.loads(text), path)
    if stripped.startswith("{") and "\n" not in stripped.strip():
        obj = json.loads(stripped)
        return _records_of(obj.get("records", [obj]), path)
    out = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # the line a killed run was writing
                continue
            raise BenchError(f"{path}:{i + 1} is not a JSON record; it was not written by oscar bench") from None
    return _records_of(out, path)


def _records_of(items: Any, path: Path) -> list[dict]:
    if not isinstance(items, list) or not all(isinstance(r, dict) and "measure" in r and "config" in r for r in items):
        raise BenchError(f"{path} holds no oscar bench records (each needs 'measure' and 'config')")
    return items


# ---------------------------------------------------------------------------------------------------- model, artifact
def model_fingerprint(config: dict) -> str:
    """The fingerprint of a random-weight model of ``config``: its config digest (``oscar_cli.models``) and the words
    "random weights", so it never equals a real checkpoint's."""
    from oscar_cli.models import config_digest

    return "sha256:" + hashlib.sha256(f"{config_digest(config)}|random weights".encode()).hexdigest()[:32]


def tokenizer_vocab(folder: Path) -> int:
    """Tokens the tokenizer in ``folder`` knows (its tokenizer.json's vocabulary and added tokens)."""
    try:
        tok = json.loads((Path(folder) / "tokenizer.json").read_text())
        vocab = tok.get("model", {}).get("vocab", {})
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
        ids += [int(a["id"]) for a in tok.get("added_tokens", [])]
        return max(ids) + 1
    except (OSError, ValueError, KeyError, TypeError):
        raise BenchError(f"{folder} has no readable tokenizer.json; pass --tokenizer with a tokenizer folder (the "
                         "converted SmolLM2 under STORE/models/smollm2-135m has one)") from None


def write_model(folder: Path, tokenizer: Path) -> Path:
    """``folder`` with the Qwen3-8B-shaped ``config.json``, the tokenizer files of ``tokenizer`` and
    ``oscar_model.json`` (the random-weight fingerprint)."""
    from oscar_cli.models import FINGERPRINT_FILE

    tokenizer = Path(tokenizer)
    found = [n for n in TOKENIZER_FILES if (tokenizer / n).is_file()]
    if "tokenizer.json" not in found:
        raise BenchError(f"--tokenizer {tokenizer} has no tokenizer.json; pass a tokenizer folder (e.g. "
                         "STORE/models/smollm2-135m after `oscar collect`)")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(QWEN3_8B_SHAPED, indent=2) + "\n")
    for n in found:
        if (tokenizer / n).resolve() != (folder / n).resolve():
            shutil.copy(tokenizer / n, folder / n)
    meta = {"source": "Qwen3-8B-shaped config, random weights (--load-format dummy)",
            "fingerprint": model_fingerprint(QWEN3_8B_SHAPED)}
    (folder / FINGERPRINT_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return folder


def random_rotations(n_layers: int, d: int, seed: int):
    """Haar-random orthogonal matrices, fp32 ``[n_layers, 1, d, d]`` (QR of a Gaussian, signs fixed by R's
    diagonal)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n_layers, d, d, generator=g, dtype=torch.float64)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small QRs: the thread pool only adds contention (seconds instead of 40 ms on 2 cores)
    try:
        q, r = torch.linalg.qr(a)
    finally:
        torch.set_num_threads(threads)
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
    return q.float().unsqueeze(1).contiguous()


def write_random_artifact(root: Path, fingerprint: str, seed: int = ROTATION_SEED) -> Path:
    """A data-free artifact for :data:`QWEN3_8B_SHAPED` under ``root/qwen3-8b-shaped/vN`` (see the module
    docstring); returns its folder."""
    import torch
    from oscar_kernels.scheme import QuantScheme

    from oscar_cli.artifact import Manifest, write_artifact
    from oscar_cli.config import AttentionShape

    c = QWEN3_8B_SHAPED
    n, h, d = c["num_hidden_layers"], c["num_key_value_heads"], c["head_dim"]
    t = {"layers": torch.arange(n), "r_k": random_rotations(n, d, seed), "r_v": random_rotations(n, d, seed + 1),
         "clip_k": torch.ones(n, 1), "clip_v": torch.ones(n, 1), "eig_k": torch.zeros(n, 1, d),
         "eig_v": torch.zeros(n, 1, d)}
    m = Manifest(model_slug=MODEL_SLUG, model_fingerprint=fingerprint, run_id=None, stats_digest="", data_digest="",
                 calibration_tokens=0, method="random-orthogonal", per_head=False, layers=tuple(range(n)),
                 shape=AttentionShape(n, c["num_attention_heads"], h, d), scheme=QuantScheme().resolved(d),
                 fit_clip=False, clip_grid=(), metrics={"seed": seed, "note": "data-free, for benchmarks only"})
    return write_artifact(Path(root), m, t, f"# oscar bench: random orthogonal rotations, seed {seed}\n")


def prepare_model(out: Path, tokenizer: Path) -> tuple[Path, Path]:
    """The model folder and its artifact under ``out`` (an artifact already there is reused when it still loads
    with the folder's fingerprint)."""
    from oscar_cli.artifact import ArtifactError, load_artifact

    model = write_model(Path(out) / "model", tokenizer)
    fp = model_fingerprint(QWEN3_8B_SHAPED)
    arts = sorted((Path(out) / "artifacts" / MODEL_SLUG).glob("v*"), key=lambda p: int(p.name[1:] or 0))
    for art in reversed(arts):
        try:
            load_artifact(art, fp)
            return model, art
        except ArtifactError:
            continue
    return model, write_random_artifact(Path(out) / "artifacts", fp)


def check_with_plugin(model: Path, artifact: Path, max_running_requests: int, context_length: int,
                      max_extend_tokens: int = 16384) -> dict:
    """The plugin's own start-time checks on CPU (no SGLang): the artifact against the folder
    (``load_checked_artifact`` with ``--load-format dummy``) and its budget for one rank (``rank_setup``). Raises
    ``ServeRefusal`` with the plugin's line; returns the notes and the budget."""
    from oscar_cli.serve.sglang.refusals import ModelFacts
    from oscar_cli.serve.sglang.settings import OscarSettings
    from oscar_cli.serve.sglang.setup import load_checked_artifact, rank_setup

    settings = OscarSettings(artifact=Path(artifact).resolve())
    facts = ModelFacts.from_folder(Path(model))
    art, notes = load_checked_artifact(settings, facts, 1, "dummy")
    setup = rank_setup(settings, art, facts, tp_size=1, tp_rank=0, request_slots=max_running_requests + 1,
                       max_tokens=max_extend_tokens, max_seq_len=context_length, notes=tuple(notes))
    b = setup.budget
    return {"notes": list(notes), "cell_bytes": b.cell, "bf16_cell_bytes": b.bf16_cell, "fixed_bytes": b.fixed,
            "scheme": setup.scheme.describe(), "artifact": str(artifact), "content_hash": art.manifest.content_hash}


# ---------------------------------------------------------------------------------------------------- server argv
def server_argv(config: ServeConfig, cfg: BenchConfig, model: Path, artifact: Path | None,
                profile_dir: Path) -> tuple[list[str], dict[str, str]]:
    """``(argv, env to add)`` of one configuration's server. oscar's goes through ``build_launch`` (which refuses
    flags the plugin cannot serve); the baselines' are plain ``sglang.launch_server`` with no plugin loaded."""
    flags = [*COMMON_FLAGS, "--mem-fraction-static", str(cfg.mem_fraction), "--context-length",
             str(cfg.context_length), "--cuda-graph-max-bs-decode", str(cfg.cuda_graph_max_bs)]
    env = {"SGLANG_TORCH_PROFILER_DIR": str(Path(profile_dir).resolve())}
    if config.backend == "oscar":
        from oscar_cli.serve.sglang.launch import build_launch

        if artifact is None:
            raise BenchError("the oscar configuration needs an artifact")
        flags += ["--max-running-requests", str(cfg.max_running_requests)]
        argv, plugin_env = build_launch(str(model), Path(artifact), "127.0.0.1", cfg.port, [*flags, *cfg.extra])
        return argv, {**env, **plugin_env}
    if config.kv_dtype is not None:
        flags += ["--kv-cache-dtype", config.kv_dtype]
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
            "--port", str(cfg.port), "--attention-backend", config.backend, *flags, *cfg.extra]
    return argv, {**env, "SGLANG_PLUGINS": NO_PLUGINS}


# ---------------------------------------------------------------------------------------------------- log parsing
DECODE_LINE = re.compile(r"Decode batch(?: \[\d+\])?, #running-req: (?P<running>\d+), #token: (?P<tokens>\d+), "
                         r"token usage: (?P<usage>[0-9.]+), .*?cuda graph: (?P<graph>True|False), "
                         r"gen throughput \(token/s\): (?P<tput>[0-9.]+), #queue-req: (?P<queue>\d+)")
"""SGLang 0.5.17's ``Decode batch`` line (``scheduler_components/metrics_reporter.py``)."""
KV_ALLOC_LINE = re.compile(r"KV Cache is allocated\. dtype: (?P<dtype>\S+), #tokens: (?P<tokens>\d+), "
                           r"K size: (?P<k>[0-9.]+) GB, V size: (?P<v>[0-9.]+) GB")
"""``KVCache._finalize_allocation_log`` (``mem_cache/memory_pool.py``; GB = 2**30 bytes)."""
OSCAR_POOL_LINE = re.compile(r"OSCAR pool: (?P<cell>\d+) B/token \((?P<ratio>[0-9.]+)x fewer than BF16's "
                             r"(?P<bf16>\d+)\); fixed (?P<fixed>[0-9.]+) MiB")
"""The plugin's budget line (``oscar_cli.serve.sglang.sizing.Budget.describe``)."""
MAX_TOKENS_LINE = re.compile(r"max_total_num_tokens=(\d+)")


def decode_lines(text: str) -> list[dict]:
    """Every ``Decode batch`` line of a server log, as numbers."""
    return [{"running": int(m["running"]), "tokens": int(m["tokens"]), "usage": float(m["usage"]),
             "graph": m["graph"] == "True", "tok_s": float(m["tput"]), "queue": int(m["queue"])}
            for m in DECODE_LINE.finditer(text)]


def server_decode_rate(text: str, batch: int) -> dict | None:
    """Median server-side gen throughput over the ``Decode batch`` lines at ``batch`` running requests and an empty
    queue (the first such line dropped: its interval can include the last prefill)."""
    lines = [x for x in decode_lines(text) if x["running"] == batch and x["queue"] == 0]
    if len(lines) > 1:
        lines = lines[1:]
    if not lines:
        return None
    return {"tok_s": statistics.median(x["tok_s"] for x in lines), "lines": len(lines),
            "cuda_graph": all(x["graph"] for x in lines)}


def kv_allocation(text: str) -> dict | None:
    """SGLang's KV allocation line (the last one: the one of the running pool)."""
    found = list(KV_ALLOC_LINE.finditer(text))
    if not found:
        return None
    m = found[-1]
    return {"dtype": m["dtype"], "tokens": int(m["tokens"]), "k_gib": float(m["k"]), "v_gib": float(m["v"])}


def oscar_budget(text: str) -> dict | None:
    m = OSCAR_POOL_LINE.search(text)
    if m is None:
        return None
    return {"cell_bytes": int(m["cell"]), "bf16_cell_bytes": int(m["bf16"]), "fixed_mib": float(m["fixed"])}


def max_tokens_from_log(text: str) -> int | None:
    found = MAX_TOKENS_LINE.findall(text)
    return int(found[-1]) if found else None


# ---------------------------------------------------------------------------------------------------- HTTP
def http_json(base: str, method: str, path: str, payload: Any = None, timeout: float = 30.0) -> Any:
    """One request to the server; the body parsed as JSON when it is JSON (text otherwise). Raises
    ``RuntimeError`` for a status other than 200."""
    host, port = base.split("//", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        body = None if payload is None else json.dumps(payload)
        conn.request(method, path, body, {"Content-Type": "application/json"} if body else {})
        r = conn.getresponse()
        data = r.read().decode(errors="replace")
    finally:
        conn.close()
    if r.status != 200:
        raise RuntimeError(f"{method} {path}: HTTP {r.status}: {data[:200]}")
    return json.loads(data) if data.strip()[:1] in ("{", "[") else data


@dataclass
class Stream:
    """One streamed ``/generate`` request: ``events`` are (perf_counter time, completion tokens so far)."""

    prompt_tokens: int
    sent: float = 0.0
    events: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    meta: dict = dataclasses.field(default_factory=dict)
    done: float | None = None
    error: str | None = None

    @property
    def tokens(self) -> int:
        return self.events[-1][1] if self.events else 0

    def tokens_at(self, t: float) -> int:
        n = 0
        for when, count in self.events:
            if when > t:
                break
            n = count
        return n


def stream_generate(base: str, ids: list[int], new_tokens: int, timeout: float, s: Stream) -> None:
    """POST /generate with ``stream`` on; fills ``s`` as chunks arrive (``meta_info.completion_tokens``)."""
    host, port = base.split("//", 1)[1].split(":")
    payload = {"input_ids": ids, "stream": True,
               "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}}
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        s.sent = time.perf_counter()
        conn.request("POST", "/generate", json.dumps(payload), {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            s.error = f"HTTP {r.status}: {r.read()[:200].decode(errors='replace')}"
            return
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            obj = json.loads(data)
            meta = obj.get("meta_info", {}) if isinstance(obj, dict) else {}
            s.events.append((time.perf_counter(), int(meta.get("completion_tokens", len(s.events) + 1))))
            s.meta = meta
        s.done = time.perf_counter()
    except (OSError, http.client.HTTPException, ValueError) as e:
        s.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def decode_window(streams: list[Stream]) -> dict | None:
    """Decode tokens/s while all ``streams`` were decoding: tokens received between the last first token and the
    first finish, over that window; None when the window is empty (or a stream failed)."""
    if not streams or any(s.error or not s.events for s in streams):
        return None
    t0 = max(s.events[0][0] for s in streams)
    t1 = min(s.events[-1][0] for s in streams)
    if t1 <= t0:
        return None
    tokens = sum(s.tokens_at(t1) - s.tokens_at(t0) for s in streams)
    return {"tokens": tokens, "seconds": t1 - t0, "tok_s": tokens / (t1 - t0)}


def token_gaps_ms(s: Stream) -> list[float]:
    """Milliseconds per token between consecutive chunks after the first (each chunk's gap over its new tokens)."""
    out = []
    for (ta, na), (tb, nb) in zip(s.events, s.events[1:], strict=False):
        if nb > na:
            out.extend([1e3 * (tb - ta) / (nb - na)] * (nb - na))
    return out


def percentile(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


# ---------------------------------------------------------------------------------------------------- trace summary
ATTENTION_KERNELS = re.compile(
    r"decode_int2|extend_int2|rotate_q_kernel|decode_rows|quantize_pack|_plan_(?:lengths|fill)|"  # oscar (kernels/)
    r"BatchDecode|BatchPrefill|SingleDecode|SinglePrefill|MergeState|VariableLengthMerge|"  # flashinfer attention
    r"(?:^|[^a-z])_fwd_kernel(?:_stage\d|_unified)?(?:$|[^a-z_])|_fwd_grouped_kernel_stage|"  # SGLang triton
    r"_copy_unified_indices|kv_indices|store_cache|store_kv|set_kv_buffer|reshape_and_cache|"  # KV writes, indices
    r"fmha|flash_fwd|flash_attn|attention", re.IGNORECASE)
"""Attention, KV-write and attention-index kernels of the three backends (flashinfer's norm, activation and
sampling kernels share its namespace and are not attention)."""
GEMM_KERNELS = re.compile(r"gemm|gemv|nvjet|xmma|cutlass|cublas|matmul|splitk", re.IGNORECASE)
"""The weight matmuls (cuBLAS/cuBLASLt/CUTLASS names on Hopper); checked after :data:`ATTENTION_KERNELS`."""


def kernel_class(name: str) -> str:
    if ATTENTION_KERNELS.search(name):
        return "attention"
    if GEMM_KERNELS.search(name):
        return "gemm"
    return "other"


def trace_summary(trace: dict, steps: int) -> dict:
    """Device time per decode step of a torch-profiler chrome trace, by :func:`kernel_class`, in ms; memcpy and
    memset count as other. ``top``: the five longest kernels."""
    by = {"attention": 0.0, "gemm": 0.0, "other": 0.0}
    names: dict[str, float] = {}
    n = 0
    for e in trace.get("traceEvents", []):
        cat = str(e.get("cat", "")).lower()
        if e.get("ph") != "X" or cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        us = float(e.get("dur", 0.0))
        name = str(e.get("name", ""))
        by["other" if cat != "kernel" else kernel_class(name)] += us
        names[name] = names.get(name, 0.0) + us
        n += 1
    steps = max(1, int(steps))
    out = {f"{k}_ms": v / 1e3 / steps for k, v in by.items()}
    out["total_ms"] = sum(by.values()) / 1e3 / steps
    out["kernels"] = n
    out["top"] = [[k[:120], v / 1e3 / steps] for k, v in sorted(names.items(), key=lambda kv: -kv[1])[:5]]
    return out


def read_trace(path: Path) -> dict:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------------- machine
def missing_runtime() -> str | None:
    """Why this machine cannot run the benchmark (one line), or None."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        return ("SGLang is not importable here; oscar bench runs SGLang 0.5.17 servers on a CUDA machine (its site "
                "first on PYTHONPATH, see benchmarks/bench_e2e.py), or pass --render RESULTS_JSON to render recorded "
                "results")
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        return ("CUDA is not available here; oscar bench needs a GPU for its SGLang servers, or pass --render "
                "RESULTS_JSON to render recorded results")
    return None


def nvidia_smi(query: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True, timeout=10).stdout
        return out.strip().splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def device_name() -> str:
    return nvidia_smi("name") or "unknown device"


def gpu_used_mib() -> float | None:
    v = nvidia_smi("memory.used")
    try:
        return float(v) if v is not None else None
    except ValueError:
        return None


class Monitor:
    """While a measurement runs: ``/v1/loads`` (running requests, KV tokens in use, token usage) and the device's
    memory, polled every :data:`POLL_S` seconds on a thread; keeps the largest values."""

    def __init__(self, base: str | None, gpu: Callable[[], float | None] = gpu_used_mib,
                 interval: float | None = None):
        self.base, self.gpu = base, gpu
        self.interval = POLL_S if interval is None else interval
        self.peak = {"running": 0, "used_tokens": 0, "token_usage": 0.0, "gpu_mib": None}
        self.last: dict = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def poll(self) -> None:
        if self.base is not None:
            try:
                loads = http_json(self.base, "GET", "/v1/loads?include=core", timeout=5).get("loads") or [{}]
                load = loads[0]
                self.last = load
                self.peak["running"] = max(self.peak["running"], int(load.get("num_running_reqs", 0)))
                self.peak["used_tokens"] = max(self.peak["used_tokens"], int(load.get("num_used_tokens", 0)))
                self.peak["token_usage"] = max(self.peak["token_usage"], float(load.get("token_usage", 0.0)))
            except (OSError, RuntimeError, ValueError, AttributeError, http.client.HTTPException):
                pass
        mib = self.gpu()
        if mib is not None:
            self.peak["gpu_mib"] = max(self.peak["gpu_mib"] or 0.0, mib)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.interval)

    def __enter__(self) -> Monitor:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.poll()


# ---------------------------------------------------------------------------------------------------- the server
class ServerError(BenchError):
    """A server that did not start or died."""


class Server:
    """One SGLang HTTP server process (own process group, cwd outside the checkout so its top-level ``kernels/``
    never shadows the PyPI package SGLang imports); its log goes to ``log``."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, port: int, cwd: Path):
        self.url = f"http://127.0.0.1:{port}"
        self.argv, self.log = argv, Path(log)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.log, "w")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(argv, env={**os.environ, **env}, cwd=str(cwd), stdout=self._f,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.start_s: float | None = None

    def wait_ready(self, timeout: float) -> float:
        """Seconds until ``/health`` answered 200 (SGLang answers 503 while starting)."""
        deadline = self.started + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"the server exited with {self.proc.returncode} while starting: "
                                  f"{self.last_error()} (log: {self.log})")
            try:
                http_json(self.url, "GET", "/health", timeout=5)
                self.start_s = time.perf_counter() - self.started
                return self.start_s
            except (OSError, RuntimeError, http.client.HTTPException):
                time.sleep(HEALTH_POLL_S)
        raise ServerError(f"the server did not answer /health within {timeout:.0f} s: {self.last_error()} "
                          f"(log: {self.log})")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def get(self, path: str, timeout: float = 30) -> Any:
        return http_json(self.url, "GET", path, timeout=timeout)

    def post(self, path: str, payload: Any = None, timeout: float = 60) -> Any:
        return http_json(self.url, "POST", path, {} if payload is None else payload, timeout=timeout)

    def log_size(self) -> int:
        self._f.flush()
        return self.log.stat().st_size

    def log_text(self, start: int = 0) -> str:
        with open(self.log, errors="replace") as f:
            f.seek(start)
            return f.read()

    def last_error(self) -> str:
        lines = [x for x in self.log_text().splitlines() if x.strip()]
        hits = [x for x in lines if re.search(r"Error|error:|refus|Traceback", x)]
        return (hits or lines or ["(empty log)"])[-1].strip()[:300]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
            except ProcessLookupError:
                pass
        self._f.close()


def start_server(config: ServeConfig, cfg: BenchConfig, model: Path, artifact: Path | None, timeout: float) -> Server:
    out = Path(cfg.out).resolve()
    argv, env = server_argv(config, cfg, model, artifact, out / "profiles")
    n = len(list((out / "logs").glob(f"server-{config.name}-*.log"))) if (out / "logs").is_dir() else 0
    srv = Server(argv, env, out / "logs" / f"server-{config.name}-{n + 1}.log", cfg.port, out)
    try:
        srv.wait_ready(timeout)
    except BaseException:
        srv.stop()
        raise
    return srv


def wait_gpu_free(gpu: Callable[[], float | None], limit_s: float = 60.0) -> None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        used = gpu()
        if used is None or used < GPU_FREE_MIB:
            return
        time.sleep(2)


# ---------------------------------------------------------------------------------------------------- progress
class Progress:
    """What the driver reports while it runs (the CLI draws it as a Rich bar)."""

    def start(self, total: int) -> None: ...

    def describe(self, text: str) -> None: ...

    def advance(self) -> None: ...


# ---------------------------------------------------------------------------------------------------- measurements
class Run:
    """One configuration's server and everything its measurements share."""

    def __init__(self, cfg: BenchConfig, config: ServeConfig, server: Any, recorder: Recorder, progress: Progress,
                 deadline: float, records: list[dict], gpu: Callable[[], float | None] = gpu_used_mib):
        self.cfg, self.config, self.server, self.recorder = cfg, config, server, recorder
        self.progress, self.deadline, self.records, self.gpu = progress, deadline, records, gpu
        self.max_total: int | None = None
        self.max_running: int | None = None
        self.vocab = 32000
        self._seed = 0
        self._prefix: list[int] | None = None

    # helpers
    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def ceiling(self, prefill_tokens: int, steps: int, batch: int, context: int) -> float:
        """A request's timeout: prefill at :data:`PREFILL_FLOOR_TOK_S`, steps at the decode ceiling, plus slack;
        capped by the time left."""
        step = STEP_CEIL_S + STEP_CEIL_S_PER_TOKEN * batch * context
        return max(5.0, min(REQUEST_SLACK_S + prefill_tokens / PREFILL_FLOOR_TOK_S + steps * step, self.left()))

    def prompt(self, n: int) -> list[int]:
        """``n`` random token ids (a new seed for every prompt, so prompts share no prefix)."""
        import random

        self._seed += 1
        rng = random.Random(f"{self.config.name}-{self._seed}")
        return [rng.randrange(FIRST_TOKEN_ID, self.vocab) for _ in range(n)]

    def largest_batch(self) -> int | None:
        n = requests_at(self.max_total, self.cfg.long_context)
        if n is None:
            return None
        return min(n, self.max_running) if self.max_running else n

    def add(self, measure: str, **values: Any) -> dict:
        rec = self.recorder.add(measure, self.config.name, **values)
        self.records.append(rec)
        return rec

    def flush(self) -> None:
        try:
            self.server.post("/flush_cache", timeout=60)
        except (OSError, RuntimeError, http.client.HTTPException):
            pass
        self._prefix = None

    def generate(self, prompts: list[list[int]], new_tokens: int, timeout: float, what: str) -> list[Stream]:
        """Stream all ``prompts`` at once; abort what is still running at ``timeout``."""
        streams = [Stream(prompt_tokens=len(p)) for p in prompts]
        threads = [threading.Thread(target=stream_generate, args=(self.server.url, p, new_tokens, timeout, s),
                                    daemon=True) for p, s in zip(prompts, streams, strict=True)]
        for t in threads:
            t.start()
        end = time.perf_counter() + timeout
        while time.perf_counter() < end:
            alive = [t for t in threads if t.is_alive()]
            if not alive:
                break
            done, first = sum(s.tokens for s in streams), sum(1 for s in streams if s.events)
            self.progress.describe(f"{self.config.name}: {what}: {first}/{len(streams)} decoding, {done} tokens")
            alive[0].join(timeout=min(0.5, max(0.0, end - time.perf_counter())))
        if any(t.is_alive() for t in threads):
            try:
                self.server.post("/abort_request", {"abort_all": True}, timeout=30)
            except (OSError, RuntimeError, http.client.HTTPException):
                pass
            for t in threads:
                t.join(timeout=10)
            for s in streams:
                if s.done is None and s.error is None:
                    s.error = f"timed out after {timeout:.0f} s"
        return streams

    def ensure_prefix(self, context: int) -> tuple[list[int], int]:
        """The shared prefix of a ``prefix`` fill (``context - decode - 32`` tokens), prefilled once, and the
        ``cached_tokens`` of a probe (prefix + a new suffix, one token). A probe that finds the prefix evicted (e.g.
        its oscar anchor recycled) prefills it again itself, and a second probe must then find it."""
        plen = context - self.cfg.decode_tokens - SUFFIX_TOKENS
        if self._prefix is None or len(self._prefix) != plen:
            self._prefix = self.prompt(plen)
            warm = self.generate([self._prefix], 1, self.ceiling(plen, 1, 1, context), "prefix prefill")[0]
            if warm.error:
                raise RuntimeError(f"prefix prefill failed: {warm.error}")
        cached = 0
        for _ in range(2):
            probe = self.generate([self._prefix + self.prompt(SUFFIX_TOKENS)], 1,
                                  self.ceiling(context, 1, 1, context), "prefix probe")[0]
            if probe.error:
                raise RuntimeError(f"prefix probe failed: {probe.error}")
            cached = int(probe.meta.get("cached_tokens", 0))
            if cached >= plen - PREFIX_SLACK:
                return self._prefix, cached
        raise RuntimeError(f"the prefix is not reused (cached_tokens {cached} of {plen} after prefilling it)")


def fill_for(cfg: BenchConfig, batch: int, context: int) -> str:
    if cfg.fill != "auto":
        return cfg.fill
    return "prefill" if batch * context <= cfg.prefill_budget else "prefix"


def server_record(run: Run) -> dict:
    """What the server says about itself right after start (see the module docstring)."""
    info = run.server.get("/server_info")
    state = (info.get("internal_states") or [{}])[0] if isinstance(info, dict) else {}
    text = run.server.log_text()
    max_total = info.get("max_total_num_tokens") if isinstance(info, dict) else None
    run.max_total = int(max_total) if max_total else max_tokens_from_log(text)
    mrr = state.get("effective_max_running_requests_per_dp") or info.get("max_running_requests")
    run.max_running = int(mrr) if mrr else None
    return run.add("server", max_total_num_tokens=run.max_total, max_running_requests=run.max_running,
                   memory_usage=state.get("memory_usage"), kv_alloc=kv_allocation(text), oscar_pool=oscar_budget(text),
                   kv=run.config.kv, backend=run.config.backend, kv_dtype=run.config.kv_dtype or "auto",
                   sglang_version=info.get("version"), start_s=getattr(run.server, "start_s", None),
                   mem_fraction=run.cfg.mem_fraction, context_length=run.cfg.context_length,
                   long_context=run.cfg.long_context, elements_per_token=ELEMENTS_PER_TOKEN,
                   requests_long=requests_at(run.max_total, run.cfg.long_context), gpu_mib=run.gpu(),
                   cuda_graph_max_bs=run.cfg.cuda_graph_max_bs, argv=getattr(run.server, "argv", None))


def measure_capacity(run: Run) -> list[dict]:
    """Admission: the 100k count of requests at ``--admission-context``, all sent at once."""
    cfg = run.cfg
    n = run.largest_batch()
    if not n:
        return [run.add("admission", skipped=f"the pool holds no {cfg.long_context}-token request")]
    prompt_len = cfg.admission_context - cfg.admission_new_tokens
    run.flush()
    mark = run.server.log_size()
    timeout = run.ceiling(n * prompt_len, cfg.admission_new_tokens, n, cfg.admission_context)
    t0 = time.perf_counter()
    with Monitor(run.server.url, run.gpu) as mon:
        streams = run.generate([run.prompt(prompt_len) for _ in range(n)], cfg.admission_new_tokens, timeout,
                               f"admission {n} x {cfg.admission_context}")
    lines = decode_lines(run.server.log_text(mark))
    errors = sorted({s.error for s in streams if s.error})
    return [run.add("admission", requests=n, context=cfg.admission_context, prompt_tokens=prompt_len,
                    new_tokens=cfg.admission_new_tokens, max_running_loads=mon.peak["running"],
                    max_running_log=max((x["running"] for x in lines), default=0),
                    used_tokens_peak=mon.peak["used_tokens"], token_usage_peak=max(
                        [mon.peak["token_usage"], *(x["usage"] for x in lines)]),
                    seconds=time.perf_counter() - t0, finished=sum(1 for s in streams if s.done and not s.error),
                    gpu_mib_peak=mon.peak["gpu_mib"], errors=errors,
                    label=f"{n} x {tokens_label(cfg.admission_context)} (the {tokens_label(cfg.long_context)} count "
                          f"at a {tokens_label(cfg.admission_context)} context)")]


def decode_at(run: Run, batch: int, context: int, roles: list[str]) -> dict:
    """One throughput point: ``batch`` requests at ``context`` tokens, filled as :func:`fill_for` says."""
    cfg = run.cfg
    fill = fill_for(cfg, batch, context)
    if fill == "prefill":
        run.flush()
    cached = None
    if fill == "prefix":
        prefix, cached = run.ensure_prefix(context)
        prompts = [prefix + run.prompt(SUFFIX_TOKENS) for _ in range(batch)]
        prefill_tokens = batch * SUFFIX_TOKENS
    else:
        prompts = [run.prompt(context - cfg.decode_tokens) for _ in range(batch)]
        prefill_tokens = batch * (context - cfg.decode_tokens)
    mark = run.server.log_size()
    timeout = run.ceiling(prefill_tokens, cfg.decode_tokens, batch, context)
    with Monitor(run.server.url, run.gpu) as mon:
        streams = run.generate(prompts, cfg.decode_tokens, timeout, f"decode bs{batch} at {context} ({fill})")
    win = decode_window(streams)
    srv = server_decode_rate(run.server.log_text(mark), batch)
    errors = sorted({s.error for s in streams if s.error})
    return run.add("throughput", batch=batch, context=context, roles=roles, fill=fill, decode_tokens=cfg.decode_tokens,
                   tok_s=win and win["tok_s"], window_tokens=win and win["tokens"], window_s=win and win["seconds"],
                   server_tok_s=srv and srv["tok_s"], server_lines=srv and srv["lines"],
                   cuda_graph=srv and srv["cuda_graph"], probe_cached_tokens=cached,
                   cached_tokens_min=min((int(s.meta.get("cached_tokens", 0)) for s in streams), default=None),
                   used_tokens_peak=mon.peak["used_tokens"], running_peak=mon.peak["running"],
                   gpu_mib_peak=mon.peak["gpu_mib"], errors=errors)


def equal_batch(run: Run) -> int | None:
    """``--equal-batch``, else the BF16 baseline's largest batch recorded (this run or earlier in the file)."""
    if run.cfg.equal_batch:
        return run.cfg.equal_batch
    for rec in reversed(run.records):
        if rec["config"] == BASELINE and rec["measure"] == "server" and rec.get("max_total_num_tokens"):
            n = requests_at(rec["max_total_num_tokens"], run.cfg.long_context)
            mrr = rec.get("max_running_requests")
            return min(n, mrr) if mrr else n
    return None


def measure_throughput(run: Run) -> list[dict]:
    largest, equal = run.largest_batch(), equal_batch(run)
    points: dict[int, list[str]] = {}
    if largest:
        points.setdefault(largest, []).append("largest")
    if equal and (largest is None or equal <= largest):
        points.setdefault(equal, []).append("equal")
    out = []
    if not points:
        return [run.add("throughput", skipped="no batch: no capacity read and no BF16 record (run --configs "
                        f"{BASELINE} first or pass --equal-batch)")]
    if equal and largest and equal > largest:
        out.append(run.add("throughput", skipped=f"equal batch {equal} exceeds this configuration's largest {largest}"))
    for batch, roles in sorted(points.items()):
        if run.left() < MIN_MEASURE_S:
            out.append(run.add("throughput", batch=batch, roles=roles, skipped="time budget spent"))
            continue
        out.append(decode_at(run, batch, run.cfg.long_context, roles))
    return out


def measure_latency(run: Run) -> list[dict]:
    cfg = run.cfg
    out = []
    for context in cfg.latency_contexts:
        if run.left() < MIN_MEASURE_S:
            out.append(run.add("latency", context=context, skipped="time budget spent"))
            continue
        run.flush()
        mark = run.server.log_size()
        prompt_len = context - cfg.decode_tokens
        with Monitor(run.server.url, run.gpu) as mon:
            s = run.generate([run.prompt(prompt_len)], cfg.decode_tokens,
                             run.ceiling(prompt_len, cfg.decode_tokens, 1, context), f"bs1 at {context}")[0]
        gaps = token_gaps_ms(s)
        srv = server_decode_rate(run.server.log_text(mark), 1)
        out.append(run.add(
            "latency", context=context, prompt_tokens=prompt_len, decode_tokens=cfg.decode_tokens,
            ttft_s=(s.events[0][0] - s.sent) if s.events else None,
            itl_ms=statistics.median(gaps) if gaps else None, itl_p90_ms=percentile(gaps, 0.9) if gaps else None,
            server_itl_ms=(1e3 / srv["tok_s"]) if srv and srv["tok_s"] else None,
            used_tokens_peak=mon.peak["used_tokens"], gpu_mib_peak=mon.peak["gpu_mib"], errors=[s.error] if s.error
            else []))
    return out


def profile_point(run: Run, batch: int, context: int) -> dict:
    """SGLang's torch profiler over :data:`PROFILE_STEPS` decode steps of ``batch`` streams at ``context``
    (prefix fill), summarised by :func:`trace_summary`."""
    cfg = run.cfg
    prefix, cached = run.ensure_prefix(context)
    pid = f"{run.config.name}-bs{batch}-{context}-{int(time.time())}"
    folder = Path(cfg.out).resolve() / "profiles"
    folder.mkdir(parents=True, exist_ok=True)
    steps = max(cfg.decode_tokens, 4 * PROFILE_STEPS)
    prompts = [prefix + run.prompt(SUFFIX_TOKENS) for _ in range(batch)]
    streams = [Stream(prompt_tokens=len(p)) for p in prompts]
    timeout = run.ceiling(batch * SUFFIX_TOKENS, steps, batch, context)
    threads = [threading.Thread(target=stream_generate, args=(run.server.url, p, steps, timeout, s), daemon=True)
               for p, s in zip(prompts, streams, strict=True)]
    for t in threads:
        t.start()
    end = time.perf_counter() + timeout
    while not all(s.events or s.error for s in streams) and time.perf_counter() < end:
        time.sleep(0.05)
    run.progress.describe(f"{run.config.name}: profiling bs{batch} at {context}")
    run.server.post("/start_profile", {"output_dir": str(folder), "num_steps": PROFILE_STEPS, "activities": ["GPU"],
                                       "with_stack": False, "record_shapes": False, "profile_id": pid}, timeout=120)
    trace, t_end = None, time.perf_counter() + min(PROFILE_TIMEOUT_S, max(5.0, run.left()))
    while trace is None and time.perf_counter() < t_end:
        for f in folder.glob(f"{pid}*.trace.json*"):
            try:
                trace = (f, read_trace(f))
            except (OSError, EOFError, ValueError):
                trace = None  # still being written
        time.sleep(0.2)
    for t in threads:
        t.join(timeout=max(1.0, end - time.perf_counter()))
    if trace is None:
        return run.add("profile", batch=batch, context=context, error=f"no trace {pid}* under {folder}")
    summary = trace_summary(trace[1], PROFILE_STEPS)
    if not summary["kernels"]:
        return run.add("profile", batch=batch, context=context, trace=str(trace[0]),
                       error="the trace holds no GPU kernels (graph replays not traced?); rerun with -- "
                             "--cuda-graph-backend-decode disabled")
    return run.add("profile", batch=batch, context=context, steps=PROFILE_STEPS, trace=str(trace[0]),
                   probe_cached_tokens=cached, **summary)


def measure_profile(run: Run) -> list[dict]:
    if run.config.name not in PROFILED:
        return [run.add("profile", skipped=f"profiles compare {', '.join(PROFILED)} only")]
    out = []
    for batch in dict.fromkeys([1, run.largest_batch() or 1]):
        if run.left() < MIN_MEASURE_S:
            out.append(run.add("profile", batch=batch, context=run.cfg.long_context, skipped="time budget spent"))
            continue
        out.append(profile_point(run, batch, run.cfg.long_context))
    return out


MEASURE_FUNCS: dict[str, Callable[[Run], list[dict]]] = {
    "capacity": measure_capacity, "throughput": measure_throughput, "latency": measure_latency,
    "profile": measure_profile,
}


def run(cfg: BenchConfig, progress: Progress | None = None, *, start: Callable[..., Any] = start_server,
        measures: dict[str, Callable[[Run], list[dict]]] | None = None, gpu: Callable[[], float | None] = gpu_used_mib,
        device: str | None = None, prepare: Callable[[BenchConfig], tuple[Path, Path]] | None = None) -> list[dict]:
    """Every selected configuration: start its server, record ``server``, run each selected measurement (a failing
    one is recorded with its error and the next one runs), stop the server. Returns this run's records; earlier
    records of the same results file count for the equal batch."""
    from oscar_cli import code_version

    progress = progress or Progress()
    measures = MEASURE_FUNCS if measures is None else measures
    t0 = time.perf_counter()
    deadline = t0 + cfg.budget_s
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    rec = Recorder(out / RESULTS_FILE, device or device_name(), code_version(), cfg.command)
    earlier = load_records(rec.path) if rec.path.is_file() else []
    records: list[dict] = list(earlier)
    model, artifact = (prepare or (lambda c: prepare_model(c.out, _tokenizer(c))))(cfg)
    vocab = min(QWEN3_8B_SHAPED["vocab_size"], tokenizer_vocab(model))
    progress.start(len(cfg.configs) * (1 + len(cfg.measures)))
    for i, name in enumerate(cfg.configs):
        config = CONFIGS[name]
        steps_left = 1 + len(cfg.measures)
        if deadline - time.perf_counter() < MIN_MEASURE_S:
            r = rec.add("server", name, skipped="time budget spent before the server start")
            records.append(r)
            for _ in range(steps_left):
                progress.advance()
            continue
        if i:
            wait_gpu_free(gpu)
        progress.describe(f"{name}: starting SGLang")
        try:
            if config.backend == "oscar":
                check = check_with_plugin(model, artifact, cfg.max_running_requests, cfg.context_length)
                records.append(rec.add("plugin_check", name, **check))
            limit = cfg.start_timeout_s if i == 0 else min(cfg.start_timeout_s, RESTART_TIMEOUT_S)
            server = start(config, cfg, model, artifact if config.backend == "oscar" else None,
                           min(limit, max(5.0, deadline - time.perf_counter())))
        except Exception as e:  # noqa: BLE001  (one configuration's failure is a record, not the end of the run)
            records.append(rec.add("server", name, error=f"{type(e).__name__}: {e}"))
            for _ in range(steps_left):
                progress.advance()
            continue
        try:
            r = Run(cfg, config, server, rec, progress, deadline, records, gpu)
            r.vocab = vocab
            server_record(r)
            progress.advance()
            for m in cfg.measures:
                progress.describe(f"{name}: {m}")
                if r.left() < MIN_MEASURE_S:
                    r.add(m, skipped="time budget spent")
                elif not server.alive():
                    r.add(m, error="the server is not running")
                else:
                    try:
                        measures[m](r)
                    except Exception as e:  # noqa: BLE001  (recorded; the next measurement still runs)
                        r.add(m, error=f"{type(e).__name__}: {e}")
                progress.advance()
        finally:
            server.stop()
    return records[len(earlier):]


def _tokenizer(cfg: BenchConfig) -> Path:
    if cfg.tokenizer is None:
        raise BenchError("pass --tokenizer with a tokenizer folder")
    return Path(cfg.tokenizer)


# ---------------------------------------------------------------------------------------------------- rendering
SUMMARY_HEADERS = ("config", "KV", "max tokens", "x BF16", "req @100k", "admitted", "bits/el", "bits/el pool",
                   "tok/s largest", "x BF16", "tok/s equal", "x BF16", "ITL 8k ms", "ITL 32k ms", "ITL 100k ms",
                   "peak GiB")
PROFILE_HEADERS = ("config", "point", "attention ms", "GEMM ms", "other ms", "total ms", "attention %")
DASH = "—"
GIB = 1 << 30


def _latest(records: list[dict], config: str, measure: str, pred: Callable[[dict], bool] = lambda r: True) -> dict | None:
    for r in reversed(records):
        if r["config"] == config and r["measure"] == measure and pred(r) and not r.get("skipped") and not r.get("error"):
            return r
    return None


def bits_per_element(server: dict) -> tuple[float | None, float | None]:
    """(bits per KV element of one token slot, bits per element over the pool's real allocation) of a ``server``
    record."""
    ept = server.get("elements_per_token") or ELEMENTS_PER_TOKEN
    cell = None
    if server.get("oscar_pool"):
        cell = 8 * server["oscar_pool"]["cell_bytes"] / ept
    else:
        dtype = str((server.get("kv_alloc") or {}).get("dtype") or server.get("kv_dtype") or "")
        cell = 8.0 if "fp8" in dtype or "float8" in dtype else 16.0 if ("bfloat16" in dtype or dtype == "auto") else None
    tokens = server.get("max_total_num_tokens")
    gib = (server.get("memory_usage") or {}).get("kvcache")
    if gib is None and server.get("kv_alloc"):
        gib = server["kv_alloc"]["k_gib"] + server["kv_alloc"]["v_gib"]
    pool = 8 * gib * GIB / (tokens * ept) if gib and tokens else None
    return cell, pool


def tokens_label(n: int) -> str:
    """32768 -> 32k, 100000 -> 100k, 512 -> 512."""
    if n >= 1000 and n % 1024 == 0:
        return f"{n // 1024}k"
    if n >= 1000 and n % 1000 == 0:
        return f"{n // 1000}k"
    return str(n)


def _fmt(v: float | None, spec: str = ".3g") -> str:
    return DASH if v is None else format(v, spec)


def _ratio(a: float | None, b: float | None) -> str:
    return DASH if a is None or not b else f"{a / b:.2f}x"


def _fill_mark(r: dict | None) -> str:
    if r is None:
        return ""
    return {"prefill": " P", "prefix": " R"}.get(r.get("fill", ""), "")


def _peak_gib(records: list[dict], config: str) -> float | None:
    peaks = [r.get("gpu_mib_peak") or r.get("gpu_mib") for r in records if r["config"] == config]
    peaks = [p for p in peaks if p]
    return max(peaks) / 1024 if peaks else None


def configs_of(records: list[dict]) -> list[str]:
    seen = {r["config"] for r in records}
    return [c for c in CONFIGS if c in seen] + sorted(seen - set(CONFIGS))


def summary_rows(records: list[dict]) -> list[list[str]]:
    """One row per configuration (cells as in :data:`SUMMARY_HEADERS`), from the latest record of each kind; ratios
    against :data:`BASELINE` (``tok/s equal`` at the same batch and context only)."""
    base = _latest(records, BASELINE, "server")
    base_tokens = base and base.get("max_total_num_tokens")
    base_large = _latest(records, BASELINE, "throughput", lambda r: "largest" in r.get("roles", []) and r.get("tok_s"))
    rows = []
    for c in configs_of(records):
        srv = _latest(records, c, "server")
        if srv is None and not any(r["config"] == c and r["measure"] != "plugin_check" for r in records):
            continue
        tokens = srv and srv.get("max_total_num_tokens")
        long_ctx = (srv or {}).get("long_context") or 100_000
        cell, pool = bits_per_element(srv) if srv else (None, None)
        adm = _latest(records, c, "admission")
        admitted = DASH if adm is None else (f"{max(adm.get('max_running_loads', 0), adm.get('max_running_log', 0))}"
                                             f"/{adm['requests']} @{tokens_label(adm['context'])}")
        large = _latest(records, c, "throughput", lambda r: "largest" in r.get("roles", []) and r.get("tok_s"))
        eq = _latest(records, c, "throughput", lambda r: "equal" in r.get("roles", []) and r.get("tok_s"))
        base_eq = eq and _latest(records, BASELINE, "throughput",
                                 lambda r, e=eq: r.get("batch") == e["batch"] and r.get("context") == e["context"]
                                 and r.get("tok_s"))
        itl = {}
        for r in records:
            if r["config"] == c and r["measure"] == "latency" and r.get("itl_ms") is not None:
                itl[r["context"]] = r["itl_ms"]
        rows.append([
            c, (srv or {}).get("kv") or (CONFIGS[c].kv if c in CONFIGS else DASH),
            DASH if tokens is None else f"{tokens:,}", _ratio(tokens, base_tokens),
            _fmt(requests_at(tokens, long_ctx), "d") if tokens else DASH, admitted, _fmt(cell, ".2f"), _fmt(pool, ".2f"),
            DASH if large is None else f"{large['tok_s']:,.0f} (bs{large['batch']}{_fill_mark(large)})",
            _ratio(large and large["tok_s"], base_large and base_large["tok_s"]),
            DASH if eq is None else f"{eq['tok_s']:,.0f} (bs{eq['batch']}{_fill_mark(eq)})",
            _ratio(eq and eq["tok_s"], base_eq and base_eq["tok_s"]),
            *(_fmt(_nearest(itl, k), ".2f") for k in (8192, 32768, 100_000)), _fmt(_peak_gib(records, c), ".1f"),
        ])
    return rows


def _nearest(values: dict[int, float], context: int) -> float | None:
    """The value measured at ``context`` (8k = 8192 or 8000, 100k = 100000 or 102400...: within 5%)."""
    for k, v in values.items():
        if abs(k - context) <= 0.05 * context:
            return v
    return None


def profile_rows(records: list[dict]) -> list[list[str]]:
    rows = []
    for r in records:
        if r["measure"] != "profile" or r.get("skipped") or r.get("error") or r.get("total_ms") is None:
            continue
        total = r["total_ms"]
        rows.append([r["config"], f"bs{r['batch']}/{tokens_label(r['context'])}", f"{r['attention_ms']:.2f}",
                     f"{r['gemm_ms']:.2f}", f"{r['other_ms']:.2f}", f"{total:.2f}",
                     DASH if not total else f"{r['attention_ms'] / total:.0%}"])
    return rows


def markdown(headers: Iterable[str], rows: list[list[str]]) -> str:
    headers = list(headers)
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def notes(records: list[dict]) -> list[str]:
    """What did not run or failed, one line each."""
    out = []
    for r in records:
        why = r.get("skipped") or r.get("error")
        if why:
            where = f" bs{r['batch']}" if r.get("batch") else f" at {r['context']}" if r.get("context") else ""
            out.append(f"{r['config']} {r['measure']}{where}: {'skipped: ' if r.get('skipped') else 'error: '}{why}")
        elif r.get("errors"):
            out.append(f"{r['config']} {r['measure']}: {'; '.join(r['errors'])}")
    return out


def results_section(records: list[dict]) -> str:
    """The ``benchmarks/RESULTS.md`` section of ``records``: title with date(s), device(s) and commit(s) of the
    records, the commands, the settings, the summary and profile tables, the labels and the notes."""
    if not records:
        raise BenchError("no records to render")
    dates = sorted({str(r.get("time", ""))[:10] for r in records if r.get("time")})
    devices = sorted({r.get("device") or "unknown device" for r in records})
    commits = sorted({r.get("commit") or "unknown" for r in records})
    synthetic = any(r.get("synthetic") for r in records)
    srv = next((r for r in records if r["measure"] == "server" and r.get("mem_fraction")), {})
    long_ctx = srv.get("long_context", 100_000)
    title = (f"## oscar bench, SGLang {srv.get('sglang_version') or SGLANG_VERSION} end to end at Qwen3-8B shapes: "
             f"{' to '.join(dict.fromkeys([dates[0], dates[-1]])) if dates else 'undated'}, {', '.join(devices)}, "
             f"commit {', '.join(commits)}")
    if synthetic:
        title += " (SYNTHETIC SAMPLE, not measured)"
    cmds = list(dict.fromkeys(r.get("command") for r in records if r.get("command")))
    check = next((r for r in reversed(records) if r["measure"] == "plugin_check"), None)
    parts = [title, ""]
    parts += [f"Command: `{c}`" for c in cmds] or ["Command: (not recorded)"]
    parts += ["", f"Random weights (`--load-format dummy`), `--mem-fraction-static {srv.get('mem_fraction', 0.85)}`, "
              f"`--context-length {srv.get('context_length', 131072)}`, `--sampling-backend pytorch`, decode CUDA "
              f"graphs up to bs{srv.get('cuda_graph_max_bs', 64)}; oscar: "
              f"{check['scheme'] if check else 'the artifact scheme'}, data-free random orthogonal rotations, "
              "`--max-running-requests` as in the command, 64 anchors. Ratios against flashinfer BF16.", "",
              markdown(SUMMARY_HEADERS, summary_rows(records)), "",
              f"req @100k: `max_total_num_tokens // {long_ctx}`. admitted: the most requests `/v1/loads` or the "
              "`Decode batch` log showed running at once, of those sent, at the context shown (a scaled-down "
              "context: the same count of shorter requests). bits/el: per token slot; bits/el pool: SGLang's KV "
              "allocation over its token capacity (oscar: with the exact regions of every request slot and anchor). "
              "tok/s: decode tokens/s of all streams while all were decoding, at a "
              f"{tokens_label(long_ctx)} context; P = distinct prompts really prefilled, R = one shared prefix reused "
              "(each step still attends over batch x context positions; the pool holds the prefix once). "
              "ITL: batch-1 median inter-token latency, prompt really prefilled. peak GiB: nvidia-smi, whole device."]
    prof = profile_rows(records)
    if prof:
        parts += ["", "One decode step, torch profiler through SGLang's `/start_profile` (kernel time per step; "
                  "attention includes KV writes and attention plans):", "", markdown(PROFILE_HEADERS, prof)]
    n = notes(records)
    if n:
        parts += ["", "Not measured / failed:", "", *[f"* {x}" for x in n]]
    return "\n".join(parts) + "\n"


def append_results(path: Path, section: str) -> None:
    with open(path, "a") as f:
        f.write("\n" + section)


PLOT_PANELS = (("tok_s_batch", "decode tokens/s vs batch (long context)", "batch", "tokens/s"),
               ("tok_s_context", "batch-1 decode tokens/s vs context", "context (tokens)", "tokens/s"),
               ("mem_batch", "memory vs batch", "batch", "GiB"),
               ("mem_context", "memory vs context (batch 1)", "context (tokens)", "GiB"))


def plot_series(records: list[dict]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """What :func:`plot` draws: panel -> line label -> sorted (x, y) points. Tokens/s against batch (throughput
    records) and context (batch-1 latency: 1000 / ITL); memory against both: the KV in use (``/v1/loads`` tokens x
    the pool's bytes per token, label ``CONFIG KV in use``) and the device's peak (``CONFIG device peak``), GiB."""
    out: dict[str, dict[str, list[tuple[float, float]]]] = {k: {} for k, *_ in PLOT_PANELS}
    for c in configs_of(records):
        srv = _latest(records, c, "server")
        per_token = None
        if srv and srv.get("max_total_num_tokens") and (srv.get("memory_usage") or {}).get("kvcache"):
            per_token = srv["memory_usage"]["kvcache"] * GIB / srv["max_total_num_tokens"]
        for measure, x_key, speed, mem in (("throughput", "batch", "tok_s_batch", "mem_batch"),
                                           ("latency", "context", "tok_s_context", "mem_context")):
            pts: dict[float, dict] = {}
            for r in records:
                if r["config"] == c and r["measure"] == measure and not r.get("skipped") and not r.get("error"):
                    pts[r[x_key]] = r
            for x in sorted(pts):
                r = pts[x]
                y = r.get("tok_s") if measure == "throughput" else (1e3 / r["itl_ms"] if r.get("itl_ms") else None)
                if y is not None:
                    out[speed].setdefault(c, []).append((x, y))
                if per_token and r.get("used_tokens_peak"):
                    out[mem].setdefault(f"{c} KV in use", []).append((x, r["used_tokens_peak"] * per_token / GIB))
                if r.get("gpu_mib_peak"):
                    out[mem].setdefault(f"{c} device peak", []).append((x, r["gpu_mib_peak"] / 1024))
    return out


def plot(records: list[dict], path: Path) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """Draw :func:`plot_series` into ``path`` (matplotlib, Agg; 2 x 2 panels; device peaks dashed); returns the
    series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = plot_series(records)
    if not any(series.values()):
        raise BenchError("no throughput or latency records to plot")
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), constrained_layout=True)
    colors = {c: f"C{i}" for i, c in enumerate(configs_of(records))}
    for ax, (key, title, xl, yl) in zip(axes.flat, PLOT_PANELS, strict=True):
        for label, pts in series[key].items():
            config = label.split(" ")[0]
            ax.plot(*zip(*pts, strict=True), marker="o", ls="--" if label.endswith("device peak") else "-",
                    color=colors.get(config), label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
        if series[key]:
            ax.legend(fontsize=7)
    if any(r.get("synthetic") for r in records):
        fig.suptitle("SYNTHETIC SAMPLE, not measured", color="red")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return series


# ---------------------------------------------------------------------------------------------------- bootstrap
def plugin_site(dest: Path, repo: Path = REPO) -> Path:
    """A folder holding the checkout's ``oscar_cli`` and ``kernels`` (as ``oscar_kernels``) and an
    ``oscar_kv.dist-info`` with the entry points of ``pyproject.toml``: what SGLang's ``load_plugins()`` discovers,
    without the checkout's top-level ``kernels/`` on the path (it would shadow the PyPI package SGLang imports)."""
    import tomllib

    dest = Path(dest)
    meta = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    info = dest / f"oscar_kv-{meta['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    for name, target in (("oscar_cli", repo / "oscar_cli"), ("oscar_kernels", repo / "kernels")):
        link = dest / name
        if link.is_symlink() or link.exists():
            if link.is_symlink() and link.resolve() == target.resolve():
                continue
            link.unlink() if link.is_symlink() else shutil.rmtree(link)
        link.symlink_to(target, target_is_directory=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: oscar-kv\nVersion: {meta['version']}\n")
    (info / "top_level.txt").write_text("oscar_cli\noscar_kernels\n")
    groups = meta.get("entry-points", {})
    (info / "entry_points.txt").write_text("".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
                                                   for g, eps in groups.items()))
    return dest


def _installed() -> bool:
    from importlib.metadata import entry_points
    from importlib.util import find_spec

    return find_spec("oscar_kernels") is not None and any(
        ep.name == "oscar" for ep in entry_points(group="sglang.srt.plugins"))


if __name__ == "__main__":
    if not _installed():
        site = plugin_site(Path(os.environ.get("TMPDIR", "/tmp")) / "oscar-bench-site")
        sys.path.append(str(site))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(site)) if p)
    from oscar_cli.cli import main as _main

    sys.argv = ["oscar", "bench", *sys.argv[1:]]
    _main()
