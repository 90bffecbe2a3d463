"""``oscar fit``: rotations and clip ratios from a collected run -> a new artifact version."""

from __future__ import annotations

from typing import Annotated

import typer

from ..methods import ROTATIONS
from ._app import DEFAULTS, ArtifactsOpt, JsonOpt, RecipeOpt, StoreOpt, app, guarded, out
from ._progress import step_progress

ROTATION_HELP = "; ".join(f"{r.name}: {r.help}" for r in ROTATIONS.values())


@app.command("fit")
@guarded(interrupted="interrupted; no artifact was written")
def fit(
    run: Annotated[str, typer.Option("--run", help="Run id or 'latest' (newest complete run).")] = "latest",
    layers: Annotated[str | None, typer.Option(help="'all' or a list like 0-5,9; other layers stay BF16.")] = None,
    method: Annotated[str | None, typer.Option(help=f"Rotation recipe. {ROTATION_HELP}. [oscar]")] = None,
    per_head: Annotated[bool | None, typer.Option("--per-head/--shared", help="One rotation per KV head instead of one per layer.")] = None,
    fit_clip: Annotated[bool | None, typer.Option("--fit-clip/--no-clip", help="Fit clip ratios on held-out rows (else plain min/max).")] = None,
    bits: Annotated[int | None, typer.Option(help="Code width the clip ratios are fitted for: 2 or 4 (the scheme's; "
                                              "the artifact records it and runs at it).")] = None,
    group: Annotated[int | None, typer.Option(help="Elements per scale/zero group (0 = one group per head row).")] = None,
    sink: Annotated[int | None, typer.Option(help="Leading tokens kept in BF16 (recorded in the artifact's scheme).")] = None,
    recent: Annotated[int | None, typer.Option(help="Most recent tokens kept in BF16 (recorded in the scheme).")] = None,
    scale_dtype: Annotated[str | None, typer.Option(help="Scale/zero storage: fp16 (32 bits per group) or fp8 (16 "
                                                     "bits, e4m3 with a fitted multiplier per layer and KV head).")] = None,
    levels: Annotated[str | None, typer.Option(help="Code levels: uniform, or fitted (4 levels per layer, K/V and KV "
                                                "head, fitted jointly with the clip; INT2).")] = None,
    center_keys: Annotated[bool | None, typer.Option("--center-keys/--no-center-keys", help="Store keys minus a "
                                                     "fitted center per layer and KV head (exact: softmax ignores "
                                                     "the shift).")] = None,
    bits_per_element: Annotated[float | None, typer.Option(
        help="Budget in storage bits per quantized element (codes + scale/zero, K and V averaged): 4-bit keys or "
             "values go to the layers where the measured sensitivity says they buy the most.")] = None,
    sensitivity_tokens: Annotated[int | None, typer.Option(
        help="Calibration tokens scored through the model with each layer's K or V quantized alone (0: none).")] = None,
    clip_criterion: Annotated[str | None, typer.Option(
        help="How clips are chosen: layer-local (each layer's metric) or logit-kl (scaled by the factor with the "
             "least final-logit KL on calibration text; needs --sensitivity-tokens).")] = None,
    key_split: Annotated[int | None, typer.Option(
        help="Offer the budget a third choice for each layer's keys: the N most-read rotated directions of every row "
             "at 4 bits and the rest at 2 (0: off; needs --bits-per-element).")] = None,
    context: Annotated[int | None, typer.Option(help="Sequence length at which the budget holds in bytes (a "
                                                 "sliding-window layer holds at most its window). [32768]")] = None,
    model: Annotated[str | None, typer.Option(help="The run's model for the sensitivity pass (default: the store's "
                                               "copy or the embedded model of the run's name).")] = None,
    recipe: RecipeOpt = None,
    no_recipe: Annotated[bool, typer.Option("--no-recipe", help="Without --recipe, fit with the built-in defaults "
                                            "instead of the run's model's recipe (recipes/<model>.yaml).")] = False,
    store: StoreOpt = DEFAULTS["store"],
    artifacts: ArtifactsOpt = DEFAULTS["artifacts"],
    json_out: JsonOpt = False,
) -> None:
    """Fit R = U·P·H per layer (and clip ratios) from a calibration run and write artifacts/<model>/v<N>/.

    The artifact's manifest records the quant scheme (bits, group, sink, recent): eval, the cache and serve run it.
    Without --recipe the run's model's recipe (recipes/<model>.yaml, the best fit measured for it) is the base when
    there is one; flags override its fields; --no-recipe starts from the built-in defaults.

    Example: oscar fit --run latest --layers all --method oscar --group 0 --sink 64 --recent 256
    """
    import dataclasses
    import json

    from ..config import ConfigError, FitConfig, default_recipe, load_recipe
    from ..jobs import check_fit, run_fit
    from ..store import Store

    if recipe and no_recipe:
        raise ConfigError("--recipe and --no-recipe exclude each other; pass one")
    st = Store(store, create=False)
    if recipe is None and not no_recipe:
        recipe = default_recipe(st.get_run(run).model_slug)
        if recipe is not None:
            out.print(f"recipe: {recipe} (the model's; --no-recipe fits with the built-in defaults)")
    rec = load_recipe(recipe) if recipe else None
    base = rec.fit if rec else FitConfig()
    scheme = dataclasses.replace(base.scheme, **{k: v for k, v in dict(bits=bits, group=group, sink=sink, recent=recent,
                                                                       scale_dtype=scale_dtype,
                                                                       center_keys=center_keys,
                                                                       levels=levels).items()
                                                 if v is not None})
    overrides = {k: v for k, v in dict(layers=layers, method=method, per_head=per_head, fit_clip=fit_clip,
                                       bits_per_element=bits_per_element, sensitivity_tokens=sensitivity_tokens,
                                       model=model, context=context, clip_criterion=clip_criterion,
                                       key_split=key_split).items()
                 if v is not None}
    cfg = dataclasses.replace(base, scheme=scheme, **overrides)
    recipe_text = rec.source if rec else _recipe_yaml(cfg)
    check_fit(st, run, cfg)
    with step_progress("fit layers, then sensitivity passes") as update:
        path, manifest = run_fit(st, run, cfg, artifacts, recipe_text, progress=update, sensitivity_progress=update)
    if json_out:
        out.print_json(json.dumps({"artifact": str(path), "manifest": manifest.to_dict()}))
        return
    s = manifest.metrics["summary"]
    out.print(f"wrote {path} ({manifest.method}, {manifest.scheme.describe()}, {len(manifest.layers)} layers, "
              f"run {manifest.run_id})")
    if "clip_scale" in manifest.metrics:
        c = manifest.metrics["clip_scale"]
        out.print(f"  clips scaled by the least final-logit KL on calibration text: keys x{c['k']:g}, values "
                  f"x{c['v']:g} (capped at 1; the distortions below are the layer-local fit's)")
    if "allocation" in manifest.metrics:
        a = manifest.metrics["allocation"]
        sch = manifest.scheme
        k4 = [i for i in manifest.layers if sch.width(i, "k") == 4]
        v4 = [i for i in manifest.layers if sch.width(i, "v") == 4]
        ks = [i for i in manifest.layers if sch.split_of(i)]
        split = (f", split keys ({max(sch.split_k)} 4-bit channels) in {ks}"
                 f" with clips {a['split_clips'][0]:g}/{a['split_clips'][1]:g}" if ks else "")
        out.print(f"  allocation: {a['bits_per_element']:.3f} bits/element at {a['context']} tokens (budget "
                  f"{a['budget']:g}); 4-bit keys in "
                  f"layers {k4 or 'none'}, 4-bit values in {v4 or 'none'}{split}")
    for kv, label in (("distortion_k", "keys"), ("distortion_v", "values")):
        m, wins = s[kv]["mean"], s[kv]["artifact_better_layers"]
        out.print(f"  {label}: held-out distortion {m['artifact']:.4f} vs hadamard {m['hadamard']:.4f} "
                  f"(+clip {m['hadamard_clip']:.4f}), identity {m['identity']:.4f}; better than hadamard on "
                  f"{wins['hadamard']}/{s[kv]['layers']} layers, than hadamard with clips on "
                  f"{wins['hadamard_clip']}/{s[kv]['layers']}")


def _recipe_yaml(cfg) -> str:
    """The effective fit settings as a recipe, for artifacts made from flags alone."""
    import dataclasses

    import yaml

    fit = dataclasses.asdict(cfg)
    fit["clip_grid"] = list(cfg.clip_grid)
    fit["clip_scale_grid"] = list(cfg.clip_scale_grid)
    fit["split_clips_hi"] = list(cfg.split_clips_hi)
    fit["split_clips_lo"] = list(cfg.split_clips_lo)
    fit["scheme"] = cfg.scheme.to_dict()
    return yaml.safe_dump({"fit": fit}, sort_keys=False)
