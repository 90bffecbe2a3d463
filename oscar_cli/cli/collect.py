"""``oscar collect``: stream calibration statistics into the store."""

from __future__ import annotations

from typing import Annotated

import typer

from ._app import DEFAULTS, ModelOpt, RecipeOpt, StoreOpt, app, guarded, out, torch_device
from ._progress import token_progress


@app.command("collect")
@guarded(interrupted="interrupted; the store keeps every completed batch (continue with --resume)")
def collect(
    model: ModelOpt = DEFAULTS["model"],
    data: Annotated[str | None, typer.Option(help="builtin:pydoc, a .txt file, or a .jsonl file (one text per line).")] = None,
    tokens: Annotated[int | None, typer.Option(help="Calibration tokens (rounded up to whole sequences).")] = None,
    seq_len: Annotated[int | None, typer.Option("--seq-len", help="Tokens per sequence.")] = None,
    batch_size: Annotated[int | None, typer.Option("--batch-size", help="Sequences per forward pass (one store flush each).")] = None,
    reservoir: Annotated[int | None, typer.Option(help="Tokens whose q/k/v rows are kept as samples.")] = None,
    store: StoreOpt = DEFAULTS["store"],
    recipe: RecipeOpt = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the newest unfinished run with the same settings.")] = False,
    device: Annotated[str, typer.Option(help="Torch device for the forward passes (cpu, cuda).")] = "cpu",
) -> None:
    """Run calibration text through a model and stream per-layer, per-KV-head statistics into the store.

    Example: oscar collect --model smollm2-135m --tokens 16384 --seq-len 512
    """
    import dataclasses

    import torch

    from ..collect import calibrate, prepare_segments, resumable_run
    from ..config import CollectConfig, load_recipe
    from ..models import load_model
    from ..store import Store

    device = torch_device(device)  # before the recipe, the data and the weights
    rec = load_recipe(recipe) if recipe else None
    base = rec.collect if rec else CollectConfig()
    overrides = {k: v for k, v in dict(data=data, tokens=tokens, seq_len=seq_len, batch_size=batch_size,
                                       reservoir=reservoir).items() if v is not None}
    cfg = dataclasses.replace(base, **overrides)
    if rec and model == DEFAULTS["model"]:
        model = rec.model
    # Validate the data before touching the store or loading weights.
    from ..data import load_documents

    load_documents(cfg.data)
    Store.verify(store)  # a damaged store is refused before the weights load
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    loaded = load_model(model, store, dtype=dtype, device=device)
    segments = prepare_segments(loaded, cfg)
    st = Store(store)
    if resume:
        resumable_run(st, loaded, cfg, segments)  # fail before any progress output
    with token_progress(f"collect {loaded.slug}") as update:
        run_id = calibrate(loaded, cfg, st, resume=resume, progress=update, device=device, segments=segments)
    run = st.get_run(run_id)
    out.print(f"run {run_id}: {run.tokens_done} tokens of {loaded.slug} ({run.model_fingerprint}), "
              f"data {run.data_digest}, stored in {st.path}")
