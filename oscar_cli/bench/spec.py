"""What ``oscar bench`` runs: the model and its artifact, the engine configurations and their server arguments.

**Model.** Qwen3-8B's architecture (:data:`QWEN3_8B_SHAPED`, written by :func:`write_model`) served with
``--load-format dummy`` (random weights: decode speed does not depend on weight values) and a copied tokenizer
folder (SmolLM2's is enough: prompts are random token ids below its vocabulary). Its artifact is data-free
(:func:`write_random_artifact`: a seeded Haar-random rotation per layer for K and one for V, clip 1.0, the
``QuantScheme`` defaults); the folder's ``oscar_model.json`` and the manifest carry the same random-weight
fingerprint, so the plugin's own checks pass, run on CPU before any server starts (:func:`check_with_plugin`).

**Configurations** (:data:`CONFIGS`, :class:`EngineConfig`): one server each, all at one ``--mem-fraction-static``,
``--context-length``, ``--sampling-backend pytorch``. ``oscar`` goes through
:func:`oscar_cli.serve.sglang.launch.build_launch` with its decode options; the baselines are plain SGLang with no
plugin loaded. They run baselines first, so the BF16 largest batch is known when oscar runs. ``--decode-tuning``
sets decode options on every oscar configuration, recorded under its own name (:func:`tuned`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oscar_kernels.scheme import DecodeOptions, DecodeOptionsError

REPO = Path(__file__).resolve().parents[2]
"""The checkout this package sits in (the plugin site and RESULTS.md default are relative to it)."""
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
class EngineConfig:
    """One benchmarked engine configuration: an SGLang attention backend, its KV dtype and, for oscar, the decode
    kernel's options."""

    name: str
    backend: str
    kv_dtype: str | None
    """``--kv-cache-dtype`` (None: SGLang's ``auto``, BF16 for this model)."""
    kv: str
    """How the table names its KV cache."""
    decode: DecodeOptions = DecodeOptions()
    """oscar: the decode kernel's options (``oscar serve --int8-scores --int8-values --decode-tuning``)."""


CONFIGS: dict[str, EngineConfig] = {c.name: c for c in (
    EngineConfig("flashinfer", "flashinfer", None, "BF16"),
    EngineConfig("flashinfer-fp8", "flashinfer", "fp8_e4m3", "FP8 e4m3"),
    EngineConfig("triton", "triton", None, "BF16"),
    EngineConfig("triton-fp8", "triton", "fp8_e4m3", "FP8 e4m3"),
    EngineConfig("oscar", "oscar", None, "INT2 g128 s64/r256"),
    EngineConfig("oscar-int8", "oscar", None, "INT2 g128 s64/r256, int8 scores", DecodeOptions(int8_scores=True)),
    EngineConfig("oscar-int8-pv", "oscar", None, "INT2 g128 s64/r256, int8 scores and values",
                 DecodeOptions(int8_scores=True, int8_values=True)),
    EngineConfig("oscar-lean", "oscar", None, "INT2 g128 s64/r256, lean tiles, movmatrix",
                 DecodeOptions(lean_tiles=True, movmatrix=True)),
    EngineConfig("oscar-int8-pv-lean", "oscar", None, "INT2 g128 s64/r256, int8 scores and values, lean tiles, "
                 "fused update, movmatrix", DecodeOptions(int8_scores=True, int8_values=True, lean_tiles=True,
                                                          fused_update=True, movmatrix=True)),
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
PROFILED = ("oscar", "oscar-int8", "oscar-int8-pv", "oscar-lean", "oscar-int8-pv-lean", "flashinfer", "triton")
"""Configurations ``profile`` runs for: oscar against BF16."""
FILLS = ("auto", "prefill", "prefix", "null")
NULL_FILL_FLAG = "null-fill.flag"
"""Under ``--out``: the flag file of a ``null`` fill (its path goes to every server as ``OSCAR_BENCH_NULL_FILL``;
while it exists their extend forwards skip the model, :mod:`oscar_cli.serve.sglang.bench_fill`)."""

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
RESTART_TIMEOUT_S = 180.0
"""Start timeout of a server whose attention backend already started once in the same command (compile caches
warm: 55 s there); a backend's first start gets ``--start-timeout`` (300 s: 139 s seen for oscar; flashinfer BF16
was still capturing its prefill CUDA graphs after 200 s on a machine where its JIT cache was cold)."""
SUFFIX_TOKENS = 32
"""Distinct tokens after the shared prefix of a ``prefix`` fill."""
PREFIX_SLACK = 2048
"""A probe counts the prefix as reused when ``cached_tokens`` is within this of its length: oscar reuses a prefix
up to an anchor, taken every 1024 positions (the plugin's default ``anchor_interval``) and at chunk ends."""
PROFILE_STEPS = 5
"""Decode steps one profile captures (SGLang's ``num_steps``)."""
PROFILE_TIMEOUT_S = 180.0
"""How long the trace export may take."""


@dataclass(frozen=True)
class BenchConfig:
    """One ``oscar bench`` run (see :mod:`.measure` for each measurement)."""

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
    commit: str | None = None
    decode_tuning: str = ""
    """Decode-kernel options set on every oscar configuration (``--decode-tuning KEY=VALUE,...``; see
    :func:`tuned`), kept as :func:`tuning_label` writes them."""

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
        try:
            object.__setattr__(self, "decode_tuning", tuning_label(self.decode_tuning))
        except DecodeOptionsError as e:
            raise BenchError(str(e)) from None
        if self.decode_tuning and not any(CONFIGS[c].backend == "oscar" for c in self.configs):
            raise BenchError("--decode-tuning applies to the oscar configurations and none is selected; add one "
                             "to --configs (e.g. oscar-int8-pv) or drop --decode-tuning")
        object.__setattr__(self, "configs", tuple(c for c in CONFIGS if c in self.configs))
        object.__setattr__(self, "measures", tuple(m for m in RUN_ORDER if m in self.measures))


def tuning_label(spec: str) -> str:
    """``--decode-tuning``'s items in one form: the keys given, in :class:`DecodeOptions`' field order, values as
    :meth:`DecodeOptions.parse` reads them (``"split_tokens=4096, movmatrix=False"`` ->
    ``"movmatrix=false,split_tokens=4096"``); keys given at their default stay (they override a configuration's own
    options). One-line :class:`DecodeOptionsError` for a bad item."""
    return DecodeOptions.parse(spec).describe(keys={item.partition("=")[0].strip() for item in spec.split(",")})


def tuned(config: EngineConfig, tuning: str) -> EngineConfig:
    """``config`` with ``--decode-tuning``'s items (:func:`tuning_label`'s form) over its own decode options (oscar
    configurations; a baseline is returned as is). The result is named ``NAME+KEY=VALUE,...`` and its KV label says
    the items, so its records never mix with the plain configuration's."""
    if config.backend != "oscar" or not tuning:
        return config
    return dataclasses.replace(config, name=f"{config.name}+{tuning}", kv=f"{config.kv}, {tuning.replace(',', ', ')}",
                               decode=DecodeOptions.parse(tuning, base=config.decode))


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
def server_argv(config: EngineConfig, cfg: BenchConfig, model: Path, artifact: Path | None,
                profile_dir: Path) -> tuple[list[str], dict[str, str]]:
    """``(argv, env to add)`` of one configuration's server. oscar's goes through ``build_launch`` (which refuses
    flags the plugin cannot serve); the baselines' are plain ``sglang.launch_server`` with no plugin loaded."""
    flags = [*COMMON_FLAGS, "--mem-fraction-static", str(cfg.mem_fraction), "--context-length",
             str(cfg.context_length), "--cuda-graph-max-bs-decode", str(cfg.cuda_graph_max_bs)]
    env = {"SGLANG_TORCH_PROFILER_DIR": str(Path(profile_dir).resolve())}
    plugins = []
    if cfg.fill == "null":  # the benchmark plugin, loaded beside oscar or alone
        from oscar_cli.serve.sglang.bench_fill import FLAG_ENV, PLUGIN

        env[FLAG_ENV] = str((Path(cfg.out) / NULL_FILL_FLAG).resolve())
        plugins.append(PLUGIN)
    if config.backend == "oscar":
        from oscar_cli.serve.sglang.launch import build_launch

        if artifact is None:
            raise BenchError("the oscar configuration needs an artifact")
        flags += ["--max-running-requests", str(cfg.max_running_requests)]
        argv, plugin_env = build_launch(str(model), Path(artifact), "127.0.0.1", cfg.port, [*flags, *cfg.extra],
                                        decode=config.decode)
        for k, v in plugin_env.items():
            env[k] = ",".join([v, *plugins]) if k == "SGLANG_PLUGINS" else v
        return argv, env
    if config.kv_dtype is not None:
        flags += ["--kv-cache-dtype", config.kv_dtype]
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
            "--port", str(cfg.port), "--attention-backend", config.backend, *flags, *cfg.extra]
    return argv, {**env, "SGLANG_PLUGINS": ",".join(plugins) or NO_PLUGINS}
