"""Calibration at scale: ``oscar collect`` then ``oscar fit`` on a random-weight model of a given architecture, timed.

Usage: python benchmarks/bench_calibration.py --tokenizer DIR [--shape qwen3-8b|qwen3-8b-narrow | --config JSON]
       [--tokens 30000] [--seq-len 2048] [--batch-size 4] [--device cuda] [--store DIR] [--artifacts DIR]
       [--per-head] [--commit SHA] [--results benchmarks/RESULTS.md]

The model is built from the architecture alone (``--shape qwen3-8b``: :data:`oscar_cli.bench.spec.QWEN3_8B_SHAPED`,
36 layers, 32 query / 8 KV heads, d 128; ``qwen3-8b-narrow``: the same attention on a narrow residual stream, see
:data:`NARROW`; or any ``config.json``) with random weights, bf16 on CUDA, fp32 on CPU:
calibration cost does not depend on weight values, and no checkpoint has to reach the machine. The calibration text
is the built-in corpus, tokenized by ``--tokenizer`` (SmolLM2's will do: its ids are below any such vocabulary).

It runs the library entry points the CLI runs (:func:`oscar_cli.collect.calibrate`, :func:`oscar_cli.jobs.run_fit`)
into a fresh store and prints one table: model build, collect (tokens/s, checkpoints, the median seconds per batch
over the first and the last third of the batches, to show that a batch costs the same however many came before it),
fit, the store's and the artifact's size on disk, and peak memory. Appends it to RESULTS.md with date, device,
commit and command.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from oscar_cli import code_version
from oscar_cli.results_md import append_section, markdown_table

NARROW = {"hidden_size": 256, "intermediate_size": 512, "vocab_size": 49152, "tie_word_embeddings": True,
          "max_position_embeddings": 4096}
"""``qwen3-8b-narrow``: Qwen3-8B's attention geometry (36 layers, 32 query / 8 KV heads, d 128: the statistics, the
store and the fit have the 8B model's sizes) on a narrow residual stream, so a CPU machine runs the forward passes."""
SHAPES = ("qwen3-8b", "qwen3-8b-narrow")


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def architecture(args) -> dict:
    if args.config:
        return json.loads(Path(args.config).read_text())
    from oscar_cli.bench.spec import QWEN3_8B_SHAPED

    return dict(QWEN3_8B_SHAPED) | (NARROW if args.shape == "qwen3-8b-narrow" else {})


def random_loaded(arch: dict, tokenizer: Path, device: str):
    """A :class:`~oscar_cli.models.LoadedModel` of ``arch`` with random weights on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from oscar_cli.models import LoadedModel, config_digest, quiet_transformers

    quiet_transformers()
    fields = {k: v for k, v in arch.items() if k not in ("architectures", "torch_dtype")}
    config = AutoConfig.for_model(**fields)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    slug = f"{config.model_type}-random"
    fp = "sha256:" + config_digest(config)[:32]  # the architecture's digest: the weights are random
    return LoadedModel(model=model, tokenizer=tok, fingerprint=fp, slug=slug, source="random weights")


def third_medians(stamps: list[float]) -> tuple[float, float]:
    """Median seconds per batch over the first and the last third of the batches (``stamps``: end of each)."""
    d = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    if not d:
        return float("nan"), float("nan")
    k = max(1, len(d) // 3)
    return statistics.median(d[:k]), statistics.median(d[-k:])


def measure(args) -> dict:
    from oscar_cli.collect import calibrate
    from oscar_cli.config import CHECKPOINT_BYTES, CollectConfig, FitConfig
    from oscar_cli.jobs import run_fit
    from oscar_cli.models import attention_shape
    from oscar_cli.stats import StatsAccumulator
    from oscar_cli.store import Store

    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    loaded = random_loaded(architecture(args), args.tokenizer, args.device)
    if cuda:
        torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    params = sum(p.numel() for p in loaded.model.parameters())
    cfg = CollectConfig(tokens=args.tokens, seq_len=args.seq_len, batch_size=args.batch_size)
    shape = attention_shape(loaded.config)
    acc_bytes = StatsAccumulator(shape, skip=cfg.skip).nbytes
    every = cfg.checkpoint_every or max(1, -(-acc_bytes // CHECKPOINT_BYTES))
    store = Store(args.store)
    stamps: list[float] = []

    def progress(done: int, total: int) -> None:
        stamps.append(time.perf_counter())

    t0 = time.perf_counter()
    run_id = calibrate(loaded, cfg, store, progress=progress, device=args.device)
    collect_s = time.perf_counter() - t0
    run = store.get_run(run_id)
    store_mb = folder_bytes(args.store) / 2**20
    del loaded
    if cuda:
        peak_gib = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.empty_cache()
    else:
        peak_gib = float("nan")
    t0 = time.perf_counter()
    path, manifest = run_fit(store, str(run_id), FitConfig(per_head=args.per_head), args.artifacts, "")
    fit_s = time.perf_counter() - t0
    first, last = third_medians(stamps)
    return dict(params=params, shape=shape, build_s=build_s, tokens=run.tokens_done, batches=run.num_batches,
                every=every, acc_mb=acc_bytes / 2**20, collect_s=collect_s, first_s=first, last_s=last,
                fit_s=fit_s, store_mb=store_mb, artifact_mb=folder_bytes(path) / 2**20, peak_gib=peak_gib,
                artifact=str(path), layers=len(manifest.layers))


def table(m: dict) -> str:
    head = ["model build s", "tokens", "batches", "checkpoint every", "accumulators MB", "collect s", "tokens/s",
            "s/batch first third", "s/batch last third", "fit s", "collect + fit s", "store MB", "artifact MB",
            "peak GPU GiB"]
    row = [f"{m['build_s']:.1f}", f"{m['tokens']:,}", str(m["batches"]), str(m["every"]), f"{m['acc_mb']:.0f}",
           f"{m['collect_s']:.1f}", f"{m['tokens'] / m['collect_s']:,.0f}", f"{m['first_s']:.2f}",
           f"{m['last_s']:.2f}", f"{m['fit_s']:.1f}", f"{m['collect_s'] + m['fit_s']:.1f}", f"{m['store_mb']:.0f}",
           f"{m['artifact_mb']:.1f}", "—" if m["peak_gib"] != m["peak_gib"] else f"{m['peak_gib']:.1f}"]
    return markdown_table(head, [row])


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, required=True, help="tokenizer folder for the calibration text")
    ap.add_argument("--shape", choices=SHAPES, default="qwen3-8b")
    ap.add_argument("--config", type=Path, default=None, help="a config.json instead of --shape")
    ap.add_argument("--tokens", type=int, default=30000)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--store", type=Path, default=None, help="fresh store folder (default: a temporary one)")
    ap.add_argument("--artifacts", type=Path, default=None, help="artifacts folder (default: inside the store)")
    ap.add_argument("--per-head", action="store_true", help="fit per-KV-head rotations")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--results", default="benchmarks/RESULTS.md")
    args = ap.parse_args(argv)
    tmp = None
    if args.store is None:
        tmp = Path(tempfile.mkdtemp(prefix="oscar-calib-"))
        args.store = tmp / "store"
    if args.store.exists() and any(args.store.iterdir()):
        sys.exit(f"--store {args.store} is not empty; pass a fresh folder (the sizes reported are of this run)")
    args.artifacts = args.artifacts or args.store / "artifacts"
    try:
        m = measure(args)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    t = table(m)
    print(t)
    s = m["shape"]
    arch = str(args.config) if args.config else f"{args.shape}-shaped"
    size = f"{m['params'] / 1e9:.2f} B" if m["params"] >= 1e9 else f"{m['params'] / 1e6:.1f} M"
    append_section(args.results, "Calibration at scale (collect + fit)", device_name(args.device),
                   args.commit or code_version(),
                   f"{arch} model with random weights ({size} parameters; {s.n_layers} layers, {s.n_heads} query / "
                   f"{s.n_kv_heads} KV heads, d {s.head_dim}), the built-in corpus in segments of {args.seq_len} tokens, "
                   f"{args.batch_size} per batch, library entry points of `oscar collect` and "
                   f"`oscar fit{' --per-head' if args.per_head else ''}` into a fresh store; s/batch: median time "
                   "between persisted batches; checkpoint every: batches per store transaction (accumulators and "
                   "reservoir).", t, command=["benchmarks/bench_calibration.py", *(argv if argv is not None else
                                                                                 sys.argv[1:])])
    return m


if __name__ == "__main__":
    main()
