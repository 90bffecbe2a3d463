"""Fitting: rotations from target covariances, clip ratios from held-out rows (pure torch: no files, no DuckDB).

Distortion metrics (what a clip ratio is chosen to minimise, and what ``inspect`` reports), on rows of one layer:

* keys: ``D_K = E[(q · (k - k̂))²] / E[(q · k)²] = E[Δkᵀ C_Q Δk] / E[kᵀ C_Q k]`` — the relative error of the
  attention logits, with the expectation over queries taken through C_Q of the reading query heads;
* values: ``D_V = Σ_t w_t ‖v_t - v̂_t‖² / Σ_t w_t ‖v_t‖²`` with ``w_t = k_t C_Q k_tᵀ`` — the score-weighted relative
  error (tokens that attract large logits weigh more), the same weighting as the value target C_S.

``k̂ = dequant(quant(k R, clip)) Rᵀ``. Rows come from the calibration reservoir, split by priority rank: even ranks
fit the clip ratios, odd ranks are held out for the reported numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from . import rotation as rot
from .config import FitConfig
from .methods import Rotation
from .quantizer import clip_bounds, fake_quant, lloyd_max, meta_multiplier


@dataclass
class LayerData:
    """One layer's calibration data. Covariances ``[H, d, d]`` float64 (``H`` KV heads); rows float32
    ``[n, H, d]`` (``q_rows``: ``[n, n_heads, d]``)."""

    cq: torch.Tensor
    ck: torch.Tensor
    cv: torch.Tensor
    cs: torch.Tensor
    co: torch.Tensor
    k_rows: torch.Tensor
    v_rows: torch.Tensor
    q_rows: torch.Tensor | None = None

    def split(self) -> tuple[LayerData, LayerData]:
        """(fit half, held-out half) of the rows; rows are assumed sorted by reservoir priority."""
        def take(sl):
            return LayerData(self.cq, self.ck, self.cv, self.cs, self.co, self.k_rows[sl], self.v_rows[sl],
                             None if self.q_rows is None else self.q_rows[sl])

        return take(slice(0, None, 2)), take(slice(1, None, 2))


@dataclass
class LayerFit:
    """One layer's fit. ``clips``: ``{width: (clip_k, clip_v)}`` (``[h]`` float64 each) as fitted for every width;
    ``clip_scale``: the (key, value) factors the base width's clips are scaled by (capped at 1) where a criterion
    other than the layer-local one chose them; :meth:`clips_at` gives the clips in effect. ``r_split``: the split key
    rotation ``[h, d, d]`` (``cfg.key_split`` 4-bit directions first; None without); ``split_clips``: its (4-bit,
    2-bit) clip pair, chosen for all layers at once (:func:`oscar_cli.jobs.choose_split_clips`)."""

    r_k: torch.Tensor  # [h, d, d] float64
    r_v: torch.Tensor
    eig_k: torch.Tensor  # [h, d]
    eig_v: torch.Tensor
    base: int
    clips: dict
    metrics: dict = field(default_factory=dict)
    data: LayerData | None = None
    center_k: torch.Tensor | None = None  # [H, d] float64, with the scheme's center_keys
    tables: dict = field(default_factory=dict)  # {width: (levels_k, levels_v)} [H, 2**width], fitted levels
    clip_scale: tuple[float, float] = (1.0, 1.0)
    r_split: torch.Tensor | None = None
    split: int = 0
    split_clips: tuple[float, float] | None = None

    def clips_at(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(clip_k, clip_v) in effect at ``width``."""
        ck, cv = self.clips[width]
        if width != self.base or self.clip_scale == (1.0, 1.0):
            return ck, cv
        fk, fv = self.clip_scale
        return (ck * fk).clamp(max=1.0), (cv * fv).clamp(max=1.0)

    @property
    def clip_k(self) -> torch.Tensor:
        return self.clips_at(self.base)[0]

    @property
    def clip_v(self) -> torch.Tensor:
        return self.clips_at(self.base)[1]


def _heads(r: torch.Tensor, n_heads: int) -> torch.Tensor:
    return r.expand(n_heads, -1, -1) if r.shape[0] == 1 else r


def roundtrip(rows: torch.Tensor, r: torch.Tensor, clip: torch.Tensor, bits: int, group: int,
              meta: str = "fp16", table: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize rows in the rotated basis and rotate back, for several clip candidates at once.

    rows ``[n, H, d]``; r ``[h, d, d]`` (h = 1 or H); clip ``[C, h]`` -> float64 ``[C, n, H, d]``. FP8 metadata
    (``meta="fp8"``) is stored in units of one multiplier per candidate and head (:func:`meta_multipliers`);
    ``table`` ``[C, H, 2**bits]``: fitted levels per candidate and head (None: uniform).
    """
    H = rows.shape[1]
    r = _heads(r.double(), H)
    clip = clip.double().expand(clip.shape[0], H)
    x = torch.einsum("nhd,hde->nhe", rows.double(), r).unsqueeze(0)
    ratio = clip.view(-1, 1, H, 1)
    mult = None
    if meta == "fp8":
        lo, hi = clip_bounds(x, ratio, group)
        mult = meta_multiplier((hi - lo) / ((1 << bits) - 1), lo, (1, 3))  # [C, 1, H, 1]
    t = None if table is None else table.double().view(table.shape[0], 1, H, 1, -1)
    xq = fake_quant(x, ratio, bits=bits, group=group, meta=meta, mult=mult, table=t)  # [C, n, H, d]
    return torch.einsum("cnhe,hde->cnhd", xq.double(), r)


def meta_multipliers(rows: torch.Tensor, r: torch.Tensor, clip: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """The FP8 metadata multiplier per KV head for rows ``[n, H, d]`` at one clip ``[h]``: float32 ``[H]``."""
    H = rows.shape[1]
    x = torch.einsum("nhd,hde->nhe", rows.double(), _heads(r.double(), H))
    lo, hi = clip_bounds(x, clip.double().expand(H).view(1, H, 1), group)
    return meta_multiplier((hi - lo) / ((1 << bits) - 1), lo, (0, 2)).view(H).float()


def key_distortion(data: LayerData, r, clip, bits: int, group: int, meta: str = "fp16",
                   center: torch.Tensor | None = None, table: torch.Tensor | None = None) -> torch.Tensor:
    """Relative logit error D_K per clip candidate and head: clip ``[C, h]`` -> ``[C, H]``; ``center`` ``[H, d]``:
    the keys are quantized minus it (and it is added back); ``table``: fitted levels (:func:`roundtrip`)."""
    k = data.k_rows.double()
    kc = k if center is None else k - center.double()
    dk = kc.unsqueeze(0) - roundtrip(kc, r, clip, bits, group, meta, table)
    num = torch.einsum("cnhd,hde,cnhe->ch", dk, data.cq, dk)
    den = torch.einsum("nhd,hde,nhe->h", k, data.cq, k)
    return num / den


def value_distortion(data: LayerData, r, clip, bits: int, group: int, meta: str = "fp16",
                     center: torch.Tensor | None = None, table: torch.Tensor | None = None) -> torch.Tensor:
    """Score-weighted relative value error D_V per clip candidate and head: clip ``[C, h]`` -> ``[C, H]``."""
    k, v = data.k_rows.double(), data.v_rows.double()
    w = torch.einsum("nhd,hde,nhe->nh", k, data.cq, k)
    dv = v.unsqueeze(0) - roundtrip(v, r, clip, bits, group, meta, table)
    num = (w * dv.pow(2).sum(-1)).sum(1)
    den = (w * v.pow(2).sum(-1)).sum(0)
    return num / den


def pooled(per_head: torch.Tensor, data: LayerData, kind: str) -> torch.Tensor:
    """Pool per-head relative distortions ``[C, H]`` into one number per candidate, weighting heads by their
    signal energy (so the pooled value is the relative error of all heads together)."""
    k = data.k_rows.double()
    w = torch.einsum("nhd,hde,nhe->nh", k, data.cq, k)
    energy = w.sum(0) if kind == "k" else (w * data.v_rows.double().pow(2).sum(-1)).sum(0)
    return (per_head * energy).sum(-1) / energy.sum()


def fit_clip(metric, data: LayerData, kind: str, r: torch.Tensor, grid: tuple[float, ...], per_head: bool
             ) -> tuple[torch.Tensor, list]:
    """Grid search of the clip ratio minimising ``metric(r, clip [C, h]) -> [C, H]``.

    Returns (clip ``[h]`` float64, curve as a list of (ratio, pooled distortion)). Shared rotations get one
    ratio per layer.
    """
    g = torch.tensor(grid, dtype=torch.float64)
    curves = metric(r, g.view(-1, 1))  # [C, H]
    total = pooled(curves, data, kind)
    curve = [(c, v.item()) for c, v in zip(grid, total, strict=True)]
    if per_head:
        return g[curves.argmin(0)], curve
    return g[total.argmin()].view(1), curve


def fit_levels(data: LayerData, kind: str, r: torch.Tensor, grid: tuple[float, ...], bits: int, group: int,
               meta: str, per_head: bool, center: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Fitted levels jointly with the clip: for every clip candidate, weighted Lloyd-Max levels per KV head of the
    rows normalized to their groups' ``[0, 2**bits - 1]`` (keys weighed per rotated direction by the query energy
    ``diag(Rᵀ C_Q R)``, values per row by the score weight ``k C_Q kᵀ``: the attention-aware objectives of
    :func:`key_distortion` / :func:`value_distortion`), then the candidate whose levels give the least distortion.
    Returns (clip ``[h]``, levels ``[H, 2**bits]``, curve)."""
    rows = (data.k_rows if kind == "k" else data.v_rows).double()
    if center is not None and kind == "k":
        rows = rows - center.double()
    H, L = rows.shape[1], (1 << bits) - 1
    rr = _heads(r.double(), H)
    x = torch.einsum("nhd,hde->nhe", rows, rr)  # [n, H, d]
    k = data.k_rows.double()
    if kind == "k":
        w = torch.einsum("hde,hdf,hfe->he", rr, data.cq, rr).clamp_min(0).unsqueeze(0).expand_as(x)  # [n, H, d]
    else:
        w = torch.einsum("nhd,hde,nhe->nh", k, data.cq, k).unsqueeze(-1).expand_as(x)
    tables = []
    for c in grid:
        lo, hi = clip_bounds(x, c, group)  # [n, H, G]
        scale = ((hi - lo) / L).clamp_min(1e-12)
        u = ((x.unflatten(-1, (-1, group)) - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(0, L).flatten(-2)
        tables.append(torch.stack([lloyd_max(u[:, h], w[:, h], bits) for h in range(H)]))
    table = torch.stack(tables)  # [C, H, L + 1]
    g = torch.tensor(grid, dtype=torch.float64)
    metric = key_distortion if kind == "k" else value_distortion
    curves = metric(data, r, g.view(-1, 1), bits, group, meta, center, table)  # [C, H]
    total = pooled(curves, data, kind)
    curve = [(cc, v.item()) for cc, v in zip(grid, total, strict=True)]
    if per_head:
        best = curves.argmin(0)  # [H]
        return g[best], table[best, torch.arange(H)], curve
    best = int(total.argmin())
    return g[best].view(1), table[best], curve


def fit_rotations(data: LayerData, rotation: Rotation, group: int, per_head: bool) -> tuple[torch.Tensor, ...]:
    """``(r_k, r_v, eig_k, eig_v)`` for one layer built by a rotation recipe: rotations ``[h, d, d]`` and target
    eigenvalues ``[h, d]``."""
    kb, vb, use_p, use_h, signs = (rotation.key_basis, rotation.value_basis, rotation.use_p, rotation.use_h,
                                   rotation.random_signs)
    covs = {"q": data.cq, "k": data.ck, "v": data.cv, "s": data.cs, "o": data.co}
    H, d = data.cq.shape[0], data.cq.shape[-1]

    def per(c: torch.Tensor) -> torch.Tensor:
        return c if per_head else c.mean(0, keepdim=True)

    def build(basis: str | None, fallback: str) -> tuple[torch.Tensor, torch.Tensor]:
        name, _, anchor_name = (basis or fallback).partition("@")
        target = per(covs[name])
        anchors = per(covs[anchor_name]) if anchor_name else [None] * len(target)
        rs, es = [], []
        for c, a in zip(target, anchors, strict=True):
            es.append(rot.eigh_desc(c)[0] if a is None else rot.anchored_eigh(a, c)[0])
            rs.append(rot.compose(c, use_u=basis is not None, use_p=use_p, use_h=use_h, group=group,
                                  signs_seed=rot.HADAMARD_SEED if signs else None, anchor=a))
        return torch.stack(rs), torch.stack(es)

    r_k, e_k = build(kb, "q")
    r_v, e_v = build(vb, "s")
    assert r_k.shape[-1] == d and r_k.shape[0] in (1, H)
    return r_k, r_v, e_k, e_v


def split_rotations(data: LayerData, m: int, per_head: bool) -> torch.Tensor:
    """The split key rotations of one layer (:func:`oscar_cli.rotation.split_rotation` of each KV head's C_Q and C_K,
    or of their means when the rotation is shared): float64 ``[h, d, d]``."""
    if per_head:
        return torch.stack([rot.split_rotation(q, k, m) for q, k in zip(data.cq, data.ck, strict=True)])
    return rot.split_rotation(data.cq.mean(0), data.ck.mean(0), m)[None]


def spectrum_summary(evals: torch.Tensor) -> dict:
    """Concentration of a descending spectrum ``[d]``: energy in the top d/8 directions, effective rank."""
    e = evals.double().clamp_min(0)
    total = e.sum().clamp_min(1e-300)
    p = e / total
    top = max(1, e.numel() // 8)
    entropy = -(p[p > 0] * p[p > 0].log()).sum().item()
    return {"top_eighth_energy": (e[:top].sum() / total).item(), "effective_rank": math.exp(entropy)}


def fit_layer(data: LayerData, cfg: FitConfig, head_dim: int, widths: tuple[int, ...] = ()) -> LayerFit:
    """Rotations, clip ratios (for the scheme's width and every width in ``widths``) and held-out distortion report
    for one layer."""
    q = cfg.scheme
    group = q.group_for(head_dim)
    meta = q.scale_dtype
    fit_half, held = data.split()
    r_k, r_v, e_k, e_v = fit_rotations(data, cfg.rotation, group, cfg.per_head)
    h = r_k.shape[0]
    center = fit_half.k_rows.double().mean(0) if q.center_keys else None  # [H, d]

    def kmetric(half, bits=q.bits, table=None):
        return lambda r, c: key_distortion(half, r, c, bits, group, meta, center, table)

    def vmetric(half, bits=q.bits, table=None):
        return lambda r, c: value_distortion(half, r, c, bits, group, meta, None, table)

    def held_out(kind, r, c, bits=q.bits, table=None):
        metric = kmetric(held, bits, table) if kind == "k" else vmetric(held, bits, table)
        return pooled(metric(r, c.view(1, -1)), held, kind).item()

    def own_table(kind, bits):
        return None if bits not in tables else tables[bits][0 if kind == "k" else 1].unsqueeze(0)

    one = torch.ones(h, dtype=torch.float64)
    clips, curves, tables = {}, {}, {}
    for bits in dict.fromkeys((q.bits, *widths)):
        if q.levels == "fitted" and bits == 2:
            grid = cfg.clip_grid if cfg.fit_clip else (1.0,)
            ck, tk, curve_k = fit_levels(fit_half, "k", r_k, grid, bits, group, meta, cfg.per_head, center)
            cv, tv, curve_v = fit_levels(fit_half, "v", r_v, grid, bits, group, meta, cfg.per_head)
            tables[bits] = (tk, tv)
        elif cfg.fit_clip:
            ck, curve_k = fit_clip(kmetric(fit_half, bits), fit_half, "k", r_k, cfg.clip_grid, cfg.per_head)
            cv, curve_v = fit_clip(vmetric(fit_half, bits), fit_half, "v", r_v, cfg.clip_grid, cfg.per_head)
        else:
            ck, cv, curve_k, curve_v = one, one, [], []
        clips[bits] = (ck.expand(h).clone(), cv.expand(h).clone())
        curves[bits] = (curve_k, curve_v)
    clip_k, clip_v = clips[q.bits]
    curve_k, curve_v = curves[q.bits]

    # Baselines on the held-out half: identity and Hadamard at plain min/max, Hadamard with its own fitted clip.
    eye = torch.eye(head_dim, dtype=torch.float64).unsqueeze(0)
    had = rot.data_free(head_dim, group)[None]
    hk, _ = fit_clip(kmetric(fit_half), fit_half, "k", had, cfg.clip_grid, False)
    hv, _ = fit_clip(vmetric(fit_half), fit_half, "v", had, cfg.clip_grid, False)
    one1 = torch.ones(1, dtype=torch.float64)

    metrics = {
        f"distortion_{kind}": {
            "identity": held_out(kind, eye, one1),
            "hadamard": held_out(kind, had, one1),
            "hadamard_clip": held_out(kind, had, hk if kind == "k" else hv),
            "artifact": held_out(kind, r_k if kind == "k" else r_v, clip_k if kind == "k" else clip_v, q.bits,
                                 own_table(kind, q.bits)),
        }
        for kind in ("k", "v")
    }
    metrics.update({
        "clip_curve_k": curve_k,
        "clip_curve_v": curve_v,
        "spectrum_k": spectrum_summary(e_k.mean(0)),
        "spectrum_v": spectrum_summary(e_v.mean(0)),
        "orthogonality_error": max(rot.orthogonality_error(m) for m in (*r_k, *r_v)),
        "held_out_rows": int(held.k_rows.shape[0]),
    })
    r_split = split_rotations(data, cfg.key_split, cfg.per_head) if cfg.key_split else None
    if len(clips) > 1:
        metrics["distortion_by_width"] = {
            str(bits): {kind: held_out(kind, r_k if kind == "k" else r_v, clips[bits][0 if kind == "k" else 1], bits,
                                       own_table(kind, bits))
                        for kind in ("k", "v")}
            for bits in clips
        }
    return LayerFit(r_k, r_v, e_k, e_v, q.bits, clips, metrics, data, center, tables, r_split=r_split,
                    split=cfg.key_split)


def _stored_keys(f: LayerFit) -> torch.Tensor:
    """A fitted layer's calibration key rows as the cache stores them (minus the center with key centering)."""
    return f.data.k_rows if f.center_k is None else f.data.k_rows - f.center_k


def layer_multipliers(f: LayerFit, bits_k: int, bits_v: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 metadata multipliers ``[H]`` of a fitted layer's keys and values at their widths, over all its rows."""
    return key_multipliers(f, bits_k, group), value_multipliers(f, bits_v, group)


def key_multipliers(f: LayerFit, bits: int, group: int) -> torch.Tensor:
    """FP8 metadata multipliers ``[H]`` of a fitted layer's (unsplit) keys at ``bits``, over all its rows."""
    return meta_multipliers(_stored_keys(f), f.r_k, f.clips_at(bits)[0], bits, group)


def value_multipliers(f: LayerFit, bits: int, group: int) -> torch.Tensor:
    """FP8 metadata multipliers ``[H]`` of a fitted layer's values at ``bits``, over all its rows."""
    return meta_multipliers(f.data.v_rows, f.r_v, f.clips_at(bits)[1], bits, group)


def split_multipliers(f: LayerFit, clips: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 metadata multipliers ``[H]`` of a fitted layer's split key rows at the (4-bit, 2-bit) ``clips``: (4-bit
    part, 2-bit part), over all its rows."""
    k = _stored_keys(f)
    m, d = f.split, f.r_split.shape[-1]
    one = torch.ones(1, dtype=torch.float64)
    return (meta_multipliers(k, f.r_split[..., :m], one * clips[0], 4, m),
            meta_multipliers(k, f.r_split[..., m:], one * clips[1], 2, d - m))


def stack_fits(layers: list[int], fits: list[LayerFit], scheme, group: int) -> dict[str, torch.Tensor]:
    """Artifact tensors (fp32) from per-layer fits: the clip ratios in effect at each layer's widths under
    ``scheme``, and what the scheme stores beside them (key centers, fitted levels, fp8 multipliers)."""
    pairs = list(zip(layers, fits, strict=True))

    def clip_k(i: int, f: LayerFit) -> torch.Tensor:
        if scheme.split_of(i):
            return torch.full_like(f.clip_k, f.split_clips[1])
        return f.clips_at(scheme.width(i, "k"))[0]

    out = {
        "layers": torch.tensor(layers, dtype=torch.int64),
        "r_k": torch.stack([f.r_split if scheme.split_of(i) else f.r_k for i, f in pairs]).float(),
        "r_v": torch.stack([f.r_v for f in fits]).float(),
        "clip_k": torch.stack([clip_k(i, f) for i, f in pairs]).float(),
        "clip_v": torch.stack([f.clips_at(scheme.width(i, "v"))[1] for i, f in pairs]).float(),
        "eig_k": torch.stack([f.eig_k for f in fits]).float(),
        "eig_v": torch.stack([f.eig_v for f in fits]).float(),
    }
    if scheme.center_keys:
        out["center_k"] = torch.stack([f.center_k for f in fits]).float()
    if scheme.levels == "fitted":
        # the INT2 units' 4 levels per KV head (an allocation's 4-bit units keep uniform levels)
        for j, kind in enumerate(("k", "v")):
            out[f"levels_{kind}"] = torch.stack([f.tables[2][j] for f in fits]).float()
    if scheme.scale_dtype == "fp8":
        # a split layer's keys: (4-bit part, 2-bit part); other layers' one multiplier (1 for the absent 4-bit part)
        keys = [split_multipliers(f, f.split_clips) if scheme.split_of(i) else
                (None, key_multipliers(f, scheme.width(i, "k"), group)) for i, f in pairs]
        out["mult_k"] = torch.stack([lo for _, lo in keys])
        out["mult_v"] = torch.stack([value_multipliers(f, scheme.width(i, "v"), group) for i, f in pairs])
        if scheme.split:
            out["mult_k_hi"] = torch.stack([torch.ones_like(lo) if hi is None else hi for hi, lo in keys])
    if scheme.split:
        # the split layers' 4-bit parts (1 in the rows of layers not split); their 2-bit parts' are clip_k / mult_k
        out["clip_k_hi"] = torch.stack([torch.full_like(f.clip_k, f.split_clips[0] if scheme.split_of(i) else 1.0)
                                        for i, f in pairs]).float()
    return out
