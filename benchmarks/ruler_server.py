"""RULER and the needle grid through a serving engine that lm-eval cannot reach from this machine (SGLang on the
GPU machine, which has no lm-eval): lm-eval builds the requests here (``prepare``: a recording lm-eval model keeps
every ``generate_until`` request with its token ids), the engine answers them there (``benchmarks/sglang_h200.py``
step ``ruler``: greedy, ``max_gen_toks`` new tokens, EOS stops), and lm-eval scores the answers here with the tasks'
own metrics (``score``: a replaying model hands each request its answer). The samples are the offline tasks'
(:mod:`oscar_cli.tasks`: RULER ``niah_single_1``, ``niah_multikey_2/3`` and the depth x length needle grid
``oscar_niah`` on the built-in held-out text), so ``oscar eval --tasks ruler`` scores the same samples the same way.

    python benchmarks/ruler_server.py prepare --model smollm2-135m --out .whl/h200/ruler.json.gz
    (GPU)  benchmarks/sglang_h200.sh with STEPS=ruler       -> answers in work/ruler-<config>.json
    python benchmarks/ruler_server.py score --requests .whl/h200/ruler.json.gz --answers DIR \
        --plot benchmarks/ruler_grid_smollm2.png

``score`` appends one table (task x length per served configuration, with the bits per element each server's KV
pool holds) to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RULER_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3")
GRID_TASK = "oscar_niah"
GRID_LENGTHS = (1024, 2048, 4096, 8192)


def key(context: str) -> str:
    return hashlib.sha1(context.encode()).hexdigest()


def _lm_class():
    from lm_eval.api.model import LM

    class Recorded(LM):
        """An lm-eval model that answers ``generate_until`` from a table (``answers``: context key -> text) and
        records every request it is asked (``asked``)."""

        def __init__(self, answers: dict[str, str] | None = None):
            super().__init__()
            self.answers, self.asked = answers, []

        def generate_until(self, requests, disable_tqdm: bool = False):
            out = []
            for r in requests:
                context, gen_kwargs = r.args
                self.asked.append((context, dict(gen_kwargs), r.doc, r.task_name))
                if self.answers is None:
                    out.append("")
                elif key(context) not in self.answers:
                    raise SystemExit(f"ruler_server: no answer for a {r.task_name} request; the answers were made "
                                     "from another requests file (run prepare and the GPU step again)")
                else:
                    out.append(self.answers[key(context)])
            return out

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError("generation tasks only")

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError("generation tasks only")

    return Recorded


def model_folder(model: str, store: Path) -> Path:
    from oscar_cli.models import quiet_transformers, resolve

    quiet_transformers()
    folder = resolve(model, store)[2]
    if folder is None:
        raise SystemExit(f"ruler_server: {model} is not a local model; pass the embedded name, a GGUF or a folder")
    return folder


def tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def evaluate(model: str, tok, samples: int, lengths: list[int], grid_samples: int, answers: dict[str, str] | None):
    """lm-eval over the offline tasks with a recording/replaying model (``tok``: the model's tokenizer, registered
    under the name ``model`` for the task generators): ``(results, model)``."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from oscar_cli.config import OFFLINE_TASKS
    from oscar_cli.eval.lm_eval_tasks import TASKS_DIR
    from oscar_cli.tasks import TOKENIZERS

    TOKENIZERS[model] = tok
    lm = _lm_class()(answers)
    results = {}
    runs = [([OFFLINE_TASKS[t] for t in RULER_TASKS], samples, lengths)]
    if grid_samples:
        runs.append(([OFFLINE_TASKS[GRID_TASK]], grid_samples, [n for n in GRID_LENGTHS if n <= max(lengths)]))
    for tasks, n, seqs in runs:
        tm = TaskManager(include_path=str(TASKS_DIR), include_defaults=False,
                         metadata={"tokenizer": model, "max_seq_lengths": seqs, "num_samples": n})
        res = lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=None, task_manager=tm, log_samples=False,
                                      bootstrap_iters=0)
        results.update(res["results"])
    return results, lm


def prepare(args) -> None:
    lengths = [int(x) for x in args.lengths.split(",")]
    folder = model_folder(args.model, args.store)
    tok = tokenizer(folder)
    _, lm = evaluate(args.model, tok, args.samples, lengths, args.grid_samples, None)
    # token ids as lm-eval's HF model encodes a context: special tokens (BOS) only for the models it adds them to
    config = json.loads((folder / "config.json").read_text())
    bos = config.get("model_type", "").startswith("gemma")
    reqs = []
    for i, (context, gen, doc, task) in enumerate(lm.asked):
        ids = tok(context, add_special_tokens=bos)["input_ids"]
        small = {k: doc[k] for k in ("max_length", "depth", "answer", "outputs") if k in doc}
        reqs.append({"id": i, "key": key(context), "task": task, "ids": ids,
                     "max_new_tokens": int(gen.get("max_gen_toks", 128)), "doc": small})
    out = {"model": args.model, "samples": args.samples, "lengths": lengths, "grid_samples": args.grid_samples,
           "requests": reqs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(args.out, "wt") as f:
        json.dump(out, f)
    tokens = sum(len(r["ids"]) for r in reqs)
    print(f"wrote {args.out}: {len(reqs)} requests, {tokens} prompt tokens "
          f"({args.out.stat().st_size / 2**20:.1f} MiB)")


def load_requests(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def score(args) -> None:
    from oscar_cli.results_md import append_section

    spec = load_requests(args.requests)
    by_id = {r["id"]: r for r in spec["requests"]}
    files = sorted(args.answers.glob("ruler-*.json"))
    if not files:
        raise SystemExit(f"ruler_server: no ruler-*.json answers under {args.answers}")
    tok = tokenizer(model_folder(spec["model"], args.store))
    table, grids, meta = {}, {}, {}
    for f in files:
        got = json.loads(f.read_text())
        name = got["config"]
        answers = {by_id[int(i)]["key"]: text for i, text in got["answers"].items()}
        missing = len(by_id) - len(answers)
        if missing:
            print(f"{name}: {missing} requests unanswered; skipped", file=sys.stderr)
            continue
        results, _ = evaluate(spec["model"], tok, spec["samples"], spec["lengths"], spec["grid_samples"], answers)
        table[name] = results
        meta[name] = got
        grids[name] = grid_cells(spec, got["answers"])
    body = render(spec, table, meta, grids)
    hf = {m.get("backend") for m in meta.values()} == {"transformers"}
    if args.plot:
        plot(grids, args.plot, spec["model"], "transformers" if hf else "SGLang")
        body += f"\n\nDepth x length grid plot: `{args.plot}`."
    card = next(iter(meta.values()))["device"]
    engine = ("transformers with OscarCache (`benchmarks/ruler_hf.py`)" if hf else "SGLang 0.5.17")
    print(append_section(args.results, f"RULER through {'transformers' if hf else 'SGLang'} ({spec['model']})", card,
                         args.commit or next(iter(meta.values())).get("commit", "unknown"),
                         f"{engine} on {'the GPU' if card != 'CPU' else 'the CPU'}; requests built and scored by "
                         "lm-eval on the CPU (`benchmarks/ruler_server.py`).", body,
                         command=["benchmarks/ruler_server.py", *sys.argv[1:]]))


def grid_cells(spec: dict, answers: dict) -> dict:
    """(length, depth) -> fraction of the needle grid's samples the task's own metric scores as retrieved."""
    from oscar_cli.config import OFFLINE_TASKS
    from oscar_cli.tasks.niah import process_results

    cells: dict[tuple[int, float], list[float]] = {}
    for r in spec["requests"]:
        if r["task"] != OFFLINE_TASKS[GRID_TASK] or "depth" not in r["doc"]:
            continue
        hit = process_results(r["doc"], [answers[str(r["id"])]])["acc"]
        cells.setdefault((r["doc"]["max_length"], r["doc"]["depth"]), []).append(hit)
    return {k: sum(v) / len(v) for k, v in cells.items()}


def render(spec: dict, table: dict, meta: dict, grids: dict) -> str:
    names = list(table)
    lengths = spec["lengths"]
    rows = [f"{spec['samples']} samples per RULER task and length (lm-eval's offline generators, noise haystacks), "
            f"greedy, up to 128 new tokens; the needle grid {spec['grid_samples']} samples per length over depths "
            "0.1..0.9 of the built-in held-out text. Bits per element: what each server's KV pool stores per "
            "cached element (its own budget line or KV allocation line; through transformers, the caches' own bytes "
            "over the elements they hold at the longest length, exact rows included).", "",
            "| configuration | bits/element | " + " | ".join(f"{t} {n // 1024}k" for t in RULER_TASKS for n in lengths)
            + " | grid (all) |",
            "| --- | --- | " + " | ".join("---" for _ in RULER_TASKS for _ in lengths) + " | --- |"]
    base = table.get("bf16")
    for name in names:
        res = table[name]
        cells = []
        for t in RULER_TASKS:
            for n in lengths:
                v = res.get(f"oscar_ruler_{t}", {}).get(f"{n},none")
                b = (base or {}).get(f"oscar_ruler_{t}", {}).get(f"{n},none")
                cells.append("-" if v is None else f"{v:.2f}" + (f" ({v / b:.2f}x)" if b and name != "bf16" else ""))
        g = res.get("oscar_niah", {}).get("acc,none")
        bits = meta[name].get("bits_per_element")
        rows.append(f"| {name} | {bits:.2f} | " if bits else f"| {name} | - | ")
        rows[-1] += " | ".join(cells) + f" | {'-' if g is None else f'{g:.2f}'} |"
    return "\n".join(rows)


def plot(grids: dict, path: Path, model: str, engine: str = "SGLang") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in grids if grids[n]]
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.0), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        cells = grids[name]
        lengths = sorted({k[0] for k in cells})
        depths = sorted({k[1] for k in cells})
        data = [[cells.get((n, d), float("nan")) for n in lengths] for d in depths]
        im = ax.imshow(data, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [f"{n // 1024}k" for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.1f}" for d in depths])
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("context")
    axes[0][0].set_ylabel("needle depth")
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
    fig.suptitle(f"needle retrieval through {engine}, {model}", fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="step", required=True)
    a = sub.add_parser("prepare", help="build the requests with lm-eval (token ids, generation settings)")
    a.add_argument("--model", default="smollm2-135m")
    a.add_argument("--store", type=Path, default=Path(".oscar"))
    a.add_argument("--samples", type=int, default=100, help="samples per RULER task and length")
    a.add_argument("--lengths", default="4096,8192")
    a.add_argument("--grid-samples", type=int, default=40, help="needle-grid samples per length (0: none)")
    a.add_argument("--out", type=Path, default=Path(".whl/h200/ruler.json.gz"))
    b = sub.add_parser("score", help="score the GPU machine's answers with lm-eval and append the table")
    b.add_argument("--requests", type=Path, default=Path(".whl/h200/ruler.json.gz"))
    b.add_argument("--answers", type=Path, required=True, help="folder with the GPU step's ruler-<config>.json")
    b.add_argument("--store", type=Path, default=Path(".oscar"))
    b.add_argument("--plot", type=Path)
    b.add_argument("--commit", default=None)
    b.add_argument("--results", type=Path, default=REPO / "benchmarks" / "RESULTS.md")
    args = p.parse_args()
    (prepare if args.step == "prepare" else score)(args)


if __name__ == "__main__":
    main()
