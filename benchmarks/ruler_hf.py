"""RULER and the needle grid answered through transformers with the project's cache: the requests that
``benchmarks/ruler_server.py prepare`` builds, answered greedily by ``model.generate`` with a fresh
:class:`oscar_cli.cache.OscarCache` per batch (the torch reference on sliding-window layers, the kernels elsewhere on
CUDA when they cover the scheme), written as ``ruler-<config>.json`` for ``ruler_server.py score``. This is the
path for models the SGLang plugin does not serve (gemma-3's sliding-window layers), on a GPU or the CPU.

    python benchmarks/ruler_server.py prepare --model gemma3-270m --store DIR --out R.json.gz
    python benchmarks/ruler_hf.py --requests R.json.gz --model gemma3-270m|FILE.gguf|FOLDER --store DIR \\
        --config NAME --method METHOD [--artifact PATH] [--sink 16 --recent 64] [--batch 16] [--batch-tokens N] \
        --out DIR
    python benchmarks/ruler_server.py score --requests R.json.gz --answers DIR --plot PNG

Requests are answered in batches of one task and length (the same answer budget), left-padded (OscarCache keeps
each row's sinks at its first real token). Bits per element: the caches' own bytes over the elements they hold
(:meth:`OscarCache.bits_per_element`), averaged over the batches of the longest length, BF16 exact rows included.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def batches(reqs: list[dict], size: int, tokens: int) -> list[list[dict]]:
    """Requests grouped by (task, length, answer budget), longest prompt first, cut into batches of at most ``size``
    requests and ``tokens`` padded prompt tokens (at least one request)."""
    groups: dict[tuple, list[dict]] = {}
    for r in reqs:
        groups.setdefault((r["task"], r["doc"].get("max_length", 0), r["max_new_tokens"]), []).append(r)
    out = []
    for key in sorted(groups):
        g = sorted(groups[key], key=lambda r: -len(r["ids"]))
        i = 0
        while i < len(g):
            n = max(1, min(size, tokens // max(1, len(g[i]["ids"]))))
            out.append(g[i : i + n])
            i += n
    return out


def answer(args) -> dict:
    import torch
    from ruler_server import load_requests

    from oscar_cli.artifact import load_artifact
    from oscar_cli.cache import cache_kwarg, make_cache
    from oscar_cli.config import QuantScheme
    from oscar_cli.methods import get_method, scheme_for
    from oscar_cli.models import load_model
    from oscar_cli.prepare import head_dim_of, prepare

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    loaded = load_model(args.model, Path(args.store), dtype=dtype)
    model, tok = loaded.model.to(device), loaded.tokenizer
    method = get_method(args.method)
    art = load_artifact(Path(args.artifact), loaded.fingerprint) if args.artifact else None
    d = head_dim_of(model.config)
    scheme = scheme_for(method, d, artifact_scheme=art.scheme if art else None,
                        reference=QuantScheme(sink=args.sink, recent=args.recent),
                        artifact_name=art.name if art else "")
    prep = prepare(model, method, scheme, art)
    kw = cache_kwarg(model)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    spec = load_requests(Path(args.requests))
    reqs = spec["requests"]
    longest = max(r["doc"].get("max_length", 0) for r in reqs)
    answers, errors, bits, backends = {}, [], [], set()
    t0 = time.perf_counter()
    todo = batches(reqs, args.batch, args.batch_tokens)
    for k, group in enumerate(todo):
        n = max(len(r["ids"]) for r in group)
        ids = torch.full((len(group), n), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(group):
            ids[j, n - len(r["ids"]) :] = torch.tensor(r["ids"])
            mask[j, n - len(r["ids"]) :] = 1
        cache = make_cache(model, prep.method, prep.quants, prep.scheme)
        try:
            with torch.no_grad():
                out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=group[0]["max_new_tokens"],
                                     do_sample=False, pad_token_id=pad, **{kw: cache})
        except Exception as e:  # noqa: BLE001 - counted and reported; those answers score 0
            errors += [f"{r['id']}: {type(e).__name__}: {e}"[:200] for r in group]
            out = None
        for j, r in enumerate(group):
            answers[str(r["id"])] = "" if out is None else tok.decode(out[j, n:], skip_special_tokens=True)
        if out is not None and hasattr(cache, "bits_per_element") and group[0]["doc"].get("max_length", 0) == longest:
            bits.append(cache.bits_per_element())
            backends.add(getattr(cache, "backend", "transformers"))
        print(f"batch {k + 1}/{len(todo)}: {group[0]['task']} {n} tokens x {len(group)}, "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else "CPU"
    return {"config": args.config, "backend": "transformers", "method": method.label,
            "cache_backend": ",".join(sorted(backends)) or None, "artifact": str(args.artifact) if art else None,
            "scheme": scheme.describe(), "device": name, "commit": args.commit, "start_s": 0.0,
            "answer_s": time.perf_counter() - t0, "bits_per_element": sum(bits) / len(bits) if bits else None,
            "errors": errors, "answers": answers}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--store", default=".oscar")
    p.add_argument("--config", required=True, help="the configuration's name in the table")
    p.add_argument("--method", default="oscar")
    p.add_argument("--artifact", default=None)
    p.add_argument("--sink", type=int, default=16, help="data-free methods' exact leading tokens")
    p.add_argument("--recent", type=int, default=64, help="data-free methods' exact recent tokens")
    p.add_argument("--batch", type=int, default=16, help="requests per batch at most")
    p.add_argument("--batch-tokens", type=int, default=32768,
                   help="padded prompt tokens per batch at most (the reference attention holds a batch's scores)")
    p.add_argument("--device", default=None)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", required=True, help="folder for ruler-<config>.json")
    args = p.parse_args(argv)
    record = answer(args)
    out = Path(args.out) / f"ruler-{args.config}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record))
    print(f"wrote {out}: {len(record['answers'])} answers, {len(record['errors'])} failed, "
          f"{record['answer_s']:.0f} s, {record['bits_per_element'] or float('nan'):.3f} bits/element")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
