"""The fit and inspect jobs: read a run from the store, call the math in fit.py, write/read artifacts.

This is the glue between the store (collect's output) and artifacts; the math lives in :mod:`oscar_cli.fit`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from . import artifact as art
from .config import AttentionShape, FitConfig, SchemeError, parse_layers
from .fit import LayerData, LayerFit, fit_layer, stack_fits
from .stats import KINDS, StatsAccumulator
from .store import Run, Store

SUMMARY_KEYS = ("identity", "hadamard", "hadamard_clip", "artifact")


def layer_data(store: Store, run: Run, layer: int, covs: dict[str, torch.Tensor]) -> LayerData:
    """Covariances (``covs[kind]``: ``[L, H, d, d]``, all layers) and reservoir rows of one layer, as fit.py wants
    them."""
    shape = AttentionShape(**run.shape)
    H, d = shape.n_kv_heads, shape.head_dim
    samples = store.load_samples(run.run_id, layer=layer)
    if (layer, "k") not in samples:
        raise art.ArtifactError(f"run {run.run_id} has no reservoir rows for layer {layer}; re-run `oscar collect`")

    def rows(kind: str, heads: int) -> torch.Tensor:
        return torch.from_numpy(samples[(layer, kind)][2]).view(-1, heads, d)

    return LayerData(
        cq=covs["q"][layer], ck=covs["k"][layer], cv=covs["v"][layer], cs=covs["s"][layer], co=covs["o"][layer],
        k_rows=rows("k", H), v_rows=rows("v", H), q_rows=rows("q", shape.n_heads),
    )


def check_fit(store: Store, run_ref: str, cfg: FitConfig, model_slug: str | None = None) -> tuple[Run, list[int]]:
    """Validate a fit request against its run before any work: -> (run, selected layers)."""
    run = store.get_run(run_ref, model_slug)
    if run.status != "complete":
        raise art.ArtifactError(
            f"run {run.run_id} is {run.status} ({run.batches_done}/{run.num_batches} batches); "
            "finish it with `oscar collect --resume` first"
        )
    shape = AttentionShape(**run.shape)
    layers = parse_layers(cfg.layers, shape.n_layers)
    try:
        cfg.scheme.group_for(shape.head_dim)
    except SchemeError as e:
        raise art.ArtifactError(f"{e}; pick --group for head dim {shape.head_dim}") from None
    check_budget(cfg, shape.head_dim)
    if cfg.sensitivity_tokens > 0:
        fit_model_spec(store, run, cfg)  # a missing model is refused before the fit's work
    return run, layers


def _widths(cfg: FitConfig, head_dim: int) -> tuple[int, ...]:
    """Widths beyond the scheme's that the budget can pay for (4-bit when it exceeds the uniform cost)."""
    q = cfg.scheme
    if cfg.bits_per_element is None or q.bits == 4:
        return ()
    return (4,) if cfg.bits_per_element > q.bits_per_element(head_dim) + 1e-9 else ()


def check_budget(cfg: FitConfig, head_dim: int) -> None:
    """A budget the scheme can meet, and the sensitivity pass that an allocation needs (one line each)."""
    if cfg.bits_per_element is None:
        return
    least = cfg.scheme.bits_per_element(head_dim)
    if cfg.bits_per_element < least - 1e-9:
        raise art.ArtifactError(f"--bits-per-element {cfg.bits_per_element:g} is below the scheme's uniform "
                                f"{cfg.scheme.bits}-bit cost of {least:g} at head dim {head_dim}; raise it, or store "
                                "the scales in fp8 (scheme scale_dtype: fp8)")
    if _widths(cfg, head_dim) and cfg.sensitivity_tokens <= 0:
        raise art.ArtifactError("an allocation above the uniform width needs the sensitivity pass; pass "
                                "--sensitivity-tokens N (e.g. 1024)")
    if cfg.key_split:
        import dataclasses

        q = cfg.scheme
        if q.bits != 2 or q.levels != "uniform":
            raise art.ArtifactError(f"--key-split splits 2-bit key rows with uniform levels; the scheme has {q.bits}-bit "
                                    f"{q.levels} codes: drop --key-split or use --bits 2 --levels uniform")
        try:
            dataclasses.replace(q, split_k=(cfg.key_split,), bits_k=(), bits_v=()).check_split(head_dim)
        except SchemeError as e:
            raise art.ArtifactError(f"--key-split {cfg.key_split}: {e}") from None
        if not _widths(cfg, head_dim):
            raise art.ArtifactError(f"--key-split needs a budget above the uniform cost of {least:g} bits per element "
                                    "to spend on split keys; raise --bits-per-element")


def fit_model_spec(store: Store, run: Run, cfg: FitConfig) -> str:
    """The model the sensitivity pass loads: ``cfg.model``, else the run's converted copy in the store, else the
    embedded model of that name; a one-line error naming ``--model`` otherwise."""
    from .models import EMBEDDED

    if cfg.model:
        return cfg.model
    folder = store.root / "models" / run.model_slug
    if (folder / "config.json").is_file():
        return str(folder)
    if run.model_slug in EMBEDDED:
        return run.model_slug
    raise art.ArtifactError(f"the sensitivity pass needs run {run.run_id}'s model ({run.model_slug}), which the "
                            "store does not hold; pass --model PATH (or --sensitivity-tokens 0)")


def load_run_model(store: Store, run: Run, cfg: FitConfig):
    """The run's model (:func:`fit_model_spec`), loaded and checked against the run's fingerprint: a
    :class:`~oscar_cli.models.LoadedModel`."""
    from .models import load_model

    loaded = load_model(fit_model_spec(store, run, cfg), store.root)
    if loaded.fingerprint != run.model_fingerprint:
        raise art.ArtifactError(f"the model loaded for the sensitivity pass ({loaded.fingerprint}) is not run "
                                f"{run.run_id}'s ({run.model_fingerprint}); pass the run's model with --model")
    return loaded


def _layer_quants(f: LayerFit, q, group: int) -> dict:
    """``{width: LayerQuant}`` of one fitted layer, at each width it was fitted for (both kinds at that width)."""
    from .fit import layer_multipliers
    from .kvquant import LayerQuant

    out = {}
    for w in f.clips:
        ck, cv = f.clips_at(w)
        mk, mv = layer_multipliers(f, w, w, group) if q.scale_dtype == "fp8" else (None, None)
        out[w] = LayerQuant(w, w, group, f.r_k.float(), f.r_v.float(), ck.float(), cv.float(), meta=q.scale_dtype,
                            mult_k=mk, mult_v=mv, center_k=None if f.center_k is None else f.center_k.float(),
                            **({} if w != 2 or 2 not in f.tables else
                               {"levels_k": f.tables[2][0].float(), "levels_v": f.tables[2][1].float()}))
    return out


def split_quant(f: LayerFit, q, group: int, clips: tuple[float, float]):
    """A :class:`~oscar_cli.kvquant.LayerQuant` of one fitted layer with its keys split (``f.split`` 4-bit directions,
    the (4-bit, 2-bit) ``clips``) and its values exact: what the split clip choice and the split KL score."""
    from .fit import split_multipliers
    from .kvquant import EXACT, LayerQuant

    h = f.r_split.shape[0]
    mk_hi, mk = split_multipliers(f, clips) if q.scale_dtype == "fp8" else (None, None)
    return LayerQuant(2, EXACT, group, f.r_split.float(), f.r_v.float(), torch.full((h,), clips[1]),
                      f.clips_at(2)[1].float(), meta=q.scale_dtype, mult_k=mk,
                      center_k=None if f.center_k is None else f.center_k.float(), split_k=f.split,
                      clip_k_hi=torch.full((h,), clips[0]), mult_k_hi=mk_hi)


def choose_split_clips(model, segments, cfg: FitConfig, layers: list[int], fits: list[LayerFit], group: int,
                       progress: Callable[[], None] | None = None) -> dict:
    """The (4-bit, 2-bit) clip pair of split key rows: the pair of ``cfg.split_clips_hi`` x ``cfg.split_clips_lo``
    with the least final-logit KL on calibration text, every fitted layer's keys split (values exact). One pair for
    all layers: the layer-local key error hardly moves with the split (benchmarks/NOTES.md), the logits do. Returns
    the choice and the curve."""
    from .sensitivity import logit_kl

    n_layers = model.config.num_hidden_layers
    configs = {}
    for pair in ((hi, lo) for hi in cfg.split_clips_hi for lo in cfg.split_clips_lo):
        quants: list = [None] * n_layers
        for layer, f in zip(layers, fits, strict=True):
            quants[layer] = split_quant(f, cfg.scheme, group, pair)
        configs[pair] = quants
    kl = logit_kl(model, segments, configs, cfg.scheme, progress=progress)
    best = min(kl, key=kl.get)
    return {"clips": list(best), "curve": [[hi, lo, v] for (hi, lo), v in kl.items()]}


def measure_split(model, segments, cfg: FitConfig, layers: list[int], fits: list[LayerFit], group: int,
                  clips: tuple[float, float], progress: Callable[[], None] | None = None) -> dict[int, float]:
    """Final-logit KL per token with each fitted layer's keys split alone (at the (4-bit, 2-bit) ``clips``), every
    other part exact: the allocation's loss for choosing split keys in that layer."""
    from .sensitivity import logit_kl

    n_layers = model.config.num_hidden_layers
    configs = {}
    for layer, f in zip(layers, fits, strict=True):
        one: list = [None] * n_layers
        one[layer] = split_quant(f, cfg.scheme, group, clips)
        configs[layer] = one
    return logit_kl(model, segments, configs, cfg.scheme, progress=progress)


def choose_clip_scale(model, segments, cfg: FitConfig, layers: list[int], fits: list[LayerFit], group: int,
                      progress: Callable[[], None] | None = None) -> dict:
    """Scale every layer's fitted clip ratios at the base width (keys, then values; capped at 1) by the factor of
    ``cfg.clip_scale_grid`` with the least final-logit KL on calibration text, every fitted layer quantized: the
    layer-local metric the clips were fitted by does not rank clip settings the way held-out perplexity does
    (benchmarks/bench_criteria.py), the final-logit KL does. Updates ``fits`` in place; returns the choice and
    the curves."""
    from .sensitivity import logit_kl

    q = cfg.scheme
    n_layers = model.config.num_hidden_layers
    base = q.bits
    chosen, curves = {"k": 1.0, "v": 1.0}, {}

    def apply(fk: float, fv: float) -> None:
        for f in fits:
            f.clip_scale = (fk, fv)

    for kind in ("k", "v"):
        configs = {}
        for factor in cfg.clip_scale_grid:
            apply(factor if kind == "k" else chosen["k"], factor if kind == "v" else 1.0)
            quants: list = [None] * n_layers
            for layer, f in zip(layers, fits, strict=True):
                quants[layer] = _layer_quants(f, q, group)[base]
            configs[factor] = quants
        kl = logit_kl(model, segments, configs, q, progress=progress)
        curves[kind] = [[f, v] for f, v in kl.items()]
        chosen[kind] = min(kl, key=kl.get)
    apply(chosen["k"], chosen["v"])
    return {"k": chosen["k"], "v": chosen["v"], "curve_k": curves["k"], "curve_v": curves["v"]}


def measure_sensitivity(store: Store, run: Run, cfg: FitConfig, layers: list[int], fits: list[LayerFit],
                        progress: Callable[[int, int], None] | None = None):
    """Load the run's model and score ``cfg.sensitivity_tokens`` calibration tokens: with ``cfg.clip_criterion``
    ``logit-kl``, first the clip scale (:func:`choose_clip_scale`, applied to ``fits``), then each fitted layer's K or
    V quantized alone (:func:`oscar_cli.sensitivity.measure`); with ``cfg.key_split``, the split clip pair
    (:func:`choose_split_clips`) and each layer's keys split alone (:func:`measure_split`). Returns (sensitivity, rows
    each layer holds at ``cfg.context``, the clip-scale report or None)."""
    import dataclasses
    import itertools

    from . import data as data_mod
    from .models import layer_tokens
    from .sensitivity import measure

    loaded = load_run_model(store, run, cfg)
    shape = AttentionShape(**run.shape)
    q = cfg.scheme
    group = q.group_for(shape.head_dim)
    n_seg = -(-cfg.sensitivity_tokens // run.seq_len)
    segments = data_mod.token_segments(loaded.tokenizer, data_mod.load_documents(run.data_spec), run.seq_len, n_seg)
    scale = None
    if cfg.clip_criterion == "logit-kl":
        steps = 2 * len(cfg.clip_scale_grid)
        done = itertools.count(1)
        scale = choose_clip_scale(loaded.model, segments, cfg, layers, fits, group,
                                  progress=None if progress is None else lambda: progress(next(done), steps))
    quants = {layer: _layer_quants(f, q, group) for layer, f in zip(layers, fits, strict=True)}
    sens = measure(loaded.model, segments, quants, q, progress=progress)
    if cfg.key_split:
        steps = len(cfg.split_clips_hi) * len(cfg.split_clips_lo) + len(layers)
        done = itertools.count(1)
        tick = None if progress is None else lambda: progress(next(done), steps)
        clips = tuple(choose_split_clips(loaded.model, segments, cfg, layers, fits, group, tick)["clips"])
        sens = dataclasses.replace(sens, split=cfg.key_split, split_clips=clips,
                                   kl_split=measure_split(loaded.model, segments, cfg, layers, fits, group, clips, tick))
    return sens, layer_tokens(loaded.model.config, cfg.context), scale


def run_fit(
    store: Store,
    run_ref: str,
    cfg: FitConfig,
    artifacts_root: Path,
    recipe_text: str,
    model_slug: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    sensitivity_progress: Callable[[int, int], None] | None = None,
    measured=None,
) -> tuple[Path, art.Manifest]:
    """Fit every selected layer of a complete run and write a new artifact version. Returns (folder, manifest).

    With ``cfg.sensitivity_tokens``, the model scores calibration text with each layer quantized alone
    (``metrics["sensitivity"]``); with a budget above the uniform width, the scheme's ``bits_k``/``bits_v`` are
    allocated from it and the clip ratios of each layer's widths are recorded. ``measured``: a (sensitivity, layer
    rows, clip scale) triple from an earlier fit of the same run and settings, reused instead of measuring again
    (sweeps)."""
    run, layers = check_fit(store, run_ref, cfg, model_slug)
    shape = AttentionShape(**run.shape)
    acc = StatsAccumulator(shape)
    acc.load_rows(store.load_stats(run.run_id))
    covs = {kind: acc.covariance(kind) for kind in KINDS}
    widths = _widths(cfg, shape.head_dim)
    fits: list[LayerFit] = []
    for i, layer in enumerate(layers):
        fits.append(fit_layer(layer_data(store, run, layer, covs), cfg, shape.head_dim, widths))
        if progress:
            progress(i + 1, len(layers))
    per_layer = {str(layer): f.metrics for layer, f in zip(layers, fits, strict=True)}
    metrics = {"per_layer": per_layer, "summary": summarize(per_layer)}
    scheme = cfg.scheme.resolved(shape.head_dim)
    if cfg.sensitivity_tokens > 0:
        from .sensitivity import allocate_scheme

        if measured is not None and cfg.clip_criterion == "logit-kl":
            sens, tokens, scale = measured
            for f in fits:  # the measured fit's clip scale, applied again
                f.clip_scale = (scale["k"], scale["v"])
        else:
            sens, tokens, scale = measured or measure_sensitivity(store, run, cfg, layers, fits, sensitivity_progress)
        if sens.split:
            if sens.split != cfg.key_split:
                raise art.ArtifactError(f"the sensitivity measured {sens.split}-channel split keys, the fit asks for "
                                        f"{cfg.key_split}; measure again")
            for f in fits:  # the measured split clip pair
                f.split_clips = sens.split_clips
        metrics["sensitivity"] = sens.to_dict()
        if scale is not None:
            metrics["clip_scale"] = scale
        if widths:
            scheme, _ = allocate_scheme(sens, scheme, shape.head_dim, shape.n_layers, cfg.bits_per_element, tokens)
            metrics["allocation"] = {"budget": cfg.bits_per_element, "context": cfg.context, "layer_tokens": tokens,
                                     "bits_per_element": scheme.bits_per_element(shape.head_dim, layers, tokens),
                                     "predicted_kl": sum(sens.unit_kl(i, kind, _choice(scheme, i, kind))
                                                         for i in layers for kind in ("k", "v"))}
            if scheme.split:
                metrics["allocation"].update(split=sens.split, split_clips=list(sens.split_clips),
                                             split_layers=[i for i in layers if scheme.split_of(i)])
    manifest = art.Manifest(
        model_slug=run.model_slug, model_fingerprint=run.model_fingerprint, run_id=run.run_id,
        stats_digest=acc.digest(), data_digest=run.data_digest, calibration_tokens=run.tokens, method=cfg.method,
        per_head=cfg.per_head, layers=tuple(layers), shape=shape, scheme=scheme,
        fit_clip=cfg.fit_clip, clip_grid=tuple(cfg.clip_grid), metrics=metrics,
    )
    tensors = stack_fits(layers, fits, scheme, scheme.group_for(shape.head_dim))
    path = art.write_artifact(artifacts_root, manifest, tensors, recipe_text)
    manifest = art.load_artifact(path).manifest
    try:
        store.register_artifact(path, manifest.to_dict())
    except BaseException:
        art.remove_artifact(path)
        raise
    return path, manifest


def _choice(scheme, layer: int, kind: str):
    """The allocation's choice for one unit: its width, or split keys."""
    from .sensitivity import SPLIT

    return SPLIT if kind == "k" and scheme.split_of(layer) else scheme.width(layer, kind)


def summarize(per_layer: dict) -> dict:
    """Mean distortions over layers and how many layers the artifact beats each baseline on."""
    out: dict = {}
    for kv in ("distortion_k", "distortion_v"):
        rows = [m[kv] for m in per_layer.values()]
        mean = {k: sum(r[k] for r in rows) / len(rows) for k in SUMMARY_KEYS}
        wins = {k: sum(r["artifact"] < r[k] for r in rows) for k in SUMMARY_KEYS if k != "artifact"}
        out[kv] = {"mean": mean, "artifact_better_layers": wins, "layers": len(rows)}
    return out


def inspect_report(artifact: art.Artifact) -> dict:
    """Everything ``oscar inspect`` shows, from the artifact alone (its tensors and fit-time metrics)."""
    from .fit import spectrum_summary
    from .rotation import orthogonality_error

    m = artifact.manifest
    t = artifact.tensors
    layers = []
    for i, layer in enumerate(artifact.layers):
        fm = m.metrics["per_layer"][str(layer)]
        layers.append({
            "layer": layer,
            "spectrum_k": spectrum_summary(t["eig_k"][i].mean(0)),
            "spectrum_v": spectrum_summary(t["eig_v"][i].mean(0)),
            "clip_k": t["clip_k"][i].tolist(),
            "clip_v": t["clip_v"][i].tolist(),
            "orthogonality_error": max(orthogonality_error(r) for r in (*t["r_k"][i], *t["r_v"][i])),
            "distortion_k": fm["distortion_k"],
            "distortion_v": fm["distortion_v"],
            "bits_k": m.scheme.width(layer, "k"),
            "bits_v": m.scheme.width(layer, "v"),
            "split_k": m.scheme.split_of(layer),
        })
        if m.scheme.split_of(layer):
            layers[-1]["clip_k_hi"] = t["clip_k_hi"][i].tolist()
        sens = m.metrics.get("sensitivity", {}).get("layers", {}).get(str(layer))
        if sens is not None:
            layers[-1]["sensitivity"] = sens
    return {
        "artifact": str(artifact.path),
        "name": artifact.name,
        "method": m.method,
        "model_slug": m.model_slug,
        "model_fingerprint": m.model_fingerprint,
        "run_id": m.run_id,
        "scheme": m.scheme.to_dict(),
        "per_head": m.per_head,
        "content_hash": m.content_hash,
        "code_version": m.code_version,
        "created": m.created,
        "layers": layers,
        "summary": m.metrics["summary"],
        "sensitivity": {k: v for k, v in m.metrics.get("sensitivity", {}).items() if k != "layers"} or None,
        "allocation": m.metrics.get("allocation"),
        "clip_scale": m.metrics.get("clip_scale"),
        "bits_per_element": m.scheme.bits_per_element(m.shape.head_dim, artifact.layers,
                                                       m.metrics.get("allocation", {}).get("layer_tokens")),
    }


def plot_report(report: dict, path: Path) -> None:
    """Spectra concentration and per-layer distortion, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [r["layer"] for r in report["layers"]]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    ax.plot(layers, [r["spectrum_k"]["top_eighth_energy"] for r in report["layers"]], "o-", label="key target")
    ax.plot(layers, [r["spectrum_v"]["top_eighth_energy"] for r in report["layers"]], "s-", label="value target")
    ax.set(title="energy in the top d/8 eigen-directions", xlabel="layer", ylim=(0, 1))
    ax.legend()
    for ax, kv, title in ((axes[1], "distortion_k", "key: relative logit error"),
                          (axes[2], "distortion_v", "value: score-weighted relative error")):
        for k in SUMMARY_KEYS:
            ax.plot(layers, [r[kv][k] for r in report["layers"]], "o-", ms=3, label=k)
        ax.set(title=title, xlabel="layer", yscale="log")
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['name']} ({report['method']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
