"""Where the quantization error lives: attention-aware sensitivity of every layer's keys and values, measured on
calibration text through the model, and the bit allocation that spends a budget where it buys the most.

Three measurements, each with only one part of the cache quantized (the decode-equivalent attention of
:mod:`oscar_cli.attention`: sinks and recent rows exact):

* ``kl`` — the final-logit KL divergence ``KL(p_exact || p)`` per token with one layer's keys (or values) quantized
  at the base width, every other part exact: what the model outputs, so what perplexity sees. One forward pass per
  layer and kind (:func:`logit_kl`).
* ``attn`` — per KV head, the relative error of the layer's attention output ``Σ‖o - ô‖² / Σ‖o‖²`` over the query
  heads that read it, with that layer's keys or values quantized, per width. Heads attend independently and every
  layer is fed exact inputs, so one forward pass per width measures every layer, head and kind (:func:`probe`).
* ``logit_err`` — per KV head, the probability-weighted key logit error ``E_q Σ_j p_j (s_j - ŝ_j)²`` (``p`` the exact
  softmax, ``s`` the scaled scores, ``j`` over the rows the query reads quantized): what the softmax sees of the key
  error, in nats² (from the same pass).

:func:`allocate` solves the multiple-choice knapsack: one width per unit (layer × K/V) minimizing the summed
predicted KL under a budget of storage bits per quantized element. The KL of a unit at another width than the base
is predicted as its measured KL times the ratio of its attention-output errors at the two widths (measured per
layer in the probe pass), so the allocation costs ``2 × layers`` passes plus one per width. Split key rows
(``oscar fit --key-split``) are a third choice for each layer's keys, their KL measured directly (one pass per layer
with that layer's keys split alone, at the clip pair chosen for all layers): a split moves the logits far more than
the layer-local or attention-output errors predict.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch

from . import attention as attn
from .config import QuantScheme
from .errors import OscarError
from .kvquant import EXACT, LayerQuant, quantized_count, roundtrip
from .models import attention_modules

PROBE_NAME = "oscar_sensitivity_probe"
_PROBE = "_oscar_probe"
KINDS = ("k", "v")
SPLIT = "split"
"""The allocation's choice of split key rows for a layer (beside the code widths)."""


class AllocationError(OscarError):
    """A bit budget that no allocation can meet."""


@dataclass
class Sensitivity:
    """Measured sensitivity of the quantized layers. ``kl[(layer, kind)]``: final-logit KL per token at the base
    width; ``attn[(layer, kind, width)]``: ``[H]`` relative attention-output error per KV head;
    ``logit_err[(layer, width)]``: ``[H]`` probability-weighted key logit error; ``tokens``: tokens scored. Split key
    rows: ``split`` 4-bit channels per row (0: not measured), ``split_clips`` their (4-bit, 2-bit) clip pair,
    ``kl_split[layer]`` the final-logit KL per token with that layer's keys split alone."""

    base: int
    widths: tuple[int, ...]
    kl: dict
    attn: dict
    logit_err: dict
    tokens: int
    split: int = 0
    split_clips: tuple[float, float] | None = None
    kl_split: dict = field(default_factory=dict)

    def unit_kl(self, layer: int, kind: str, choice) -> float:
        """KL of one unit at ``choice``: a width (:meth:`predicted_kl`) or :data:`SPLIT` (measured)."""
        return self.kl_split[layer] if choice == SPLIT else self.predicted_kl(layer, kind, choice)

    def predicted_kl(self, layer: int, kind: str, width: int) -> float:
        """KL of one unit at ``width``: measured at the base width, scaled by the attention-output error ratio."""
        base = self.kl[(layer, kind)]
        if width == self.base:
            return base
        num = float(self.attn[(layer, kind, width)].sum())
        den = float(self.attn[(layer, kind, self.base)].sum())
        return base * (num / den if den > 0 else 0.0)

    def to_dict(self) -> dict:
        """JSON form (the artifact's ``metrics["sensitivity"]``), per layer."""
        layers = sorted({lk[0] for lk in self.kl})
        out = {
            "base": self.base, "widths": list(self.widths), "tokens": self.tokens,
            "layers": {
                str(i): {
                    "kl_k": self.kl[(i, "k")], "kl_v": self.kl[(i, "v")],
                    **({"kl_k_split": self.kl_split[i]} if i in self.kl_split else {}),
                    **{f"attn_{kind}{w}": self.attn[(i, kind, w)].tolist() for kind in KINDS for w in self.widths},
                    **{f"logit_err{w}": self.logit_err[(i, w)].tolist() for w in self.widths},
                }
                for i in layers
            },
        }
        if self.split:
            out.update(split=self.split, split_clips=list(self.split_clips))
        return out

    @classmethod
    def from_dict(cls, d: dict) -> Sensitivity:
        """Inverse of :meth:`to_dict` (the artifact's ``metrics["sensitivity"]``)."""
        widths = tuple(d["widths"])
        kl, attn, logit, kl_split = {}, {}, {}, {}
        for i, row in d["layers"].items():
            i = int(i)
            if "kl_k_split" in row:
                kl_split[i] = row["kl_k_split"]
            for kind in KINDS:
                kl[(i, kind)] = row[f"kl_{kind}"]
                for w in widths:
                    attn[(i, kind, w)] = torch.tensor(row[f"attn_{kind}{w}"])
            for w in widths:
                logit[(i, w)] = torch.tensor(row[f"logit_err{w}"])
        clips = d.get("split_clips")
        return cls(d["base"], widths, kl, attn, logit, d["tokens"], int(d.get("split", 0)),
                   None if clips is None else (float(clips[0]), float(clips[1])), kl_split)


# ----------------------------------------------------------------------------------------------------------------
# Measurements


@contextlib.contextmanager
def _probing(model, state: dict) -> Iterator[None]:
    """Route attention through :func:`_probe_attention` with ``state`` (per layer: (LayerQuant at each width,
    scheme, results)) while the block runs."""
    from transformers import AttentionInterface

    AttentionInterface.register(PROBE_NAME, _probe_attention)
    mods = attention_modules(model)
    old = model.config._attn_implementation
    model.config._attn_implementation = PROBE_NAME
    for i, m in mods.items():
        setattr(m, _PROBE, state.get(i))
    try:
        yield
    finally:
        for m in mods.values():
            m.__dict__.pop(_PROBE, None)
        model.config._attn_implementation = old


def _per_kv_head(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum ``[B, T, Hq, d]`` over everything but the KV head a query head reads: ``[kv_heads]`` float64."""
    b, t, hq, d = x.shape
    return x.double().view(b, t, kv_heads, hq // kv_heads, d).sum((0, 1, 3, 4))


def _probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    scaling = module.scaling if scaling is None else scaling
    n, T = key.shape[2], query.shape[2]
    q_pos = torch.arange(n - T, n, device=query.device)
    allowed = attn.to_bool_mask(attention_mask, query.shape[0], q_pos, n)
    out = attn.mixed_attention(query, key, value, allowed, scaling)
    st = getattr(module, _PROBE, None)
    if st is None:
        return out, None
    quants, scheme, res = st
    H = key.shape[1]
    energy = _per_kv_head(out.float().pow(2), H)
    sink_end = attn.first_real(allowed) + scheme.sink
    qstart = int(sink_end.min())
    block = next(iter(quants.values())).token_block
    qend = qstart + quantized_count(n, qstart, scheme.recent, block)
    if qend > qstart:  # the exact softmax over the rows read quantized, shared by every width
        g = query.shape[1] // H
        qf = query.float()
        s = (qf @ key.float().repeat_interleave(g, 1).transpose(-1, -2)) * scaling
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)[..., qstart:qend]
        p = p * attn.rt_mask(q_pos, qstart, qend - qstart, sink_end, qstart, scheme.recent, block)  # [B, Hq, T, L]
    for w, lq in quants.items():
        for kind in KINDS:
            one = replace(lq, bits_k=w if kind == "k" else EXACT, bits_v=w if kind == "v" else EXACT)
            o = attn.decode_equivalent(query, key, value, allowed, scaling, one, scheme, q_pos)
            err = _per_kv_head((o.float() - out.float()).pow(2), H)
            res.setdefault(("attn", kind, w), []).append((err, energy))
        if qend <= qstart:
            continue
        rows = key[:, :, qstart:qend]
        dk = roundtrip(rows, replace(lq, bits_k=w, bits_v=EXACT), "k") - rows.float()
        ds = (qf @ dk.repeat_interleave(g, 1).transpose(-1, -2)) * scaling
        e = (p * ds.pow(2)).sum(-1)  # [B, Hq, T]
        b = e.shape[0]
        res.setdefault(("logit", w), []).append(
            (e.double().view(b, H, g, T).sum((0, 2, 3)), torch.full((H,), float(b * g * T), dtype=torch.float64)))
    return out, None


@torch.no_grad()
def probe(model, segments: torch.Tensor, quants: dict[int, dict[int, LayerQuant]], scheme: QuantScheme,
          batch: int = 1) -> tuple[dict, dict]:
    """Attention-output error and key logit error of every layer in ``quants`` (``{layer: {width: LayerQuant}}``),
    over ``segments [S, L]``: ``({(layer, kind, width): [H]}, {(layer, width): [H]})``."""
    dev = next(model.parameters()).device
    state = {i: (q, scheme, {}) for i, q in quants.items()}
    with _probing(model, state):
        for s in range(0, segments.shape[0], batch):
            model(segments[s : s + batch].to(dev), use_cache=False)
    attn_err, logit_err = {}, {}
    for i, (_, _, res) in state.items():
        for key, parts in res.items():
            num = sum(p[0] for p in parts)
            den = sum(p[1] for p in parts)
            val = (num / den.clamp_min(1e-300)).float()
            if key[0] == "attn":
                attn_err[(i, key[1], key[2])] = val
            else:
                logit_err[(i, key[1])] = val
    return attn_err, logit_err


def _log_probs(model, segments: torch.Tensor, batch: int) -> list[torch.Tensor]:
    dev = next(model.parameters()).device
    return [torch.log_softmax(model(segments[s : s + batch].to(dev), use_cache=False).logits.float(), -1)
            for s in range(0, segments.shape[0], batch)]


@torch.no_grad()
def logit_kl(model, segments: torch.Tensor, configs: dict, scheme: QuantScheme, batch: int = 1,
             progress: Callable[[], None] | None = None) -> dict:
    """``KL(p_exact || p)`` per token (mean over ``segments [S, L]``) for each entry of ``configs``
    (``{name: [LayerQuant | None] per model layer}``), through the decode-equivalent attention."""
    n_layers = model.config.num_hidden_layers
    attn.install(model, None, None)
    ref = _log_probs(model, segments, batch)
    out = {}
    try:
        for name, quants in configs.items():
            attn.install(model, quants[:n_layers], scheme)
            total, count = 0.0, 0
            for lp_ref, lp in zip(ref, _log_probs(model, segments, batch), strict=True):
                lp_ref, lp = lp_ref.double(), lp.double()
                total += (lp_ref.exp() * (lp_ref - lp)).sum().item()
                count += lp.shape[0] * lp.shape[1]
            out[name] = max(total / count, 0.0)  # >= 0; a part that changes nothing can round a hair below
            if progress is not None:
                progress()
    finally:
        attn.install(model, None, None)
    return out


def measure(model, segments: torch.Tensor, quants: dict[int, dict[int, LayerQuant]], scheme: QuantScheme,
            batch: int = 1, progress: Callable[[int, int], None] | None = None) -> Sensitivity:
    """Every measurement of the module docstring for the layers in ``quants`` (``{layer: {width: LayerQuant}}``,
    the base width ``scheme.bits`` among the widths)."""
    base = scheme.bits
    widths = tuple(sorted({w for q in quants.values() for w in q}))
    if any(base not in q for q in quants.values()):
        raise ValueError(f"every layer needs a quantizer at the base width {base}")
    n_layers = model.config.num_hidden_layers
    total = 1 + 2 * len(quants)
    done = itertools.count(1)
    attn_err, logit_err = probe(model, segments, quants, scheme, batch)
    if progress:
        progress(next(done), total)
    configs = {}
    for i, q in quants.items():
        for kind in KINDS:
            one: list[LayerQuant | None] = [None] * n_layers
            one[i] = replace(q[base], bits_k=base if kind == "k" else EXACT, bits_v=base if kind == "v" else EXACT)
            configs[(i, kind)] = one
    kl = logit_kl(model, segments, configs, scheme, batch,
                  progress=None if progress is None else lambda: progress(next(done), total))
    return Sensitivity(base, widths, kl, attn_err, logit_err, int(segments.numel()))


# ----------------------------------------------------------------------------------------------------------------
# Allocation


def allocate(losses: dict, weights: dict, costs: dict[int, float], budget: float, resolution: int = 64) -> dict:
    """Multiple-choice knapsack, solved exactly by dynamic programming over integer weights.

    ``losses[unit][width]``: the predicted loss of ``unit`` at ``width``; ``weights[unit]``: its element count;
    ``costs[width]``: storage bits per element at ``width`` (code + metadata); ``budget``: the largest allowed
    average bits per element over all units. Returns ``{unit: width}`` minimizing the summed loss. Element counts
    and costs are put on an integer grid of ``1/resolution`` bit (exact when they are multiples of it, as the schemes'
    are: ``bits + meta_bits / group``)."""
    units = list(losses)
    if not units:
        return {}
    g = math.gcd(*(int(weights[u]) for u in units))
    w = {u: int(weights[u]) // g for u in units}
    cost = {b: round(c * resolution) for b, c in costs.items()}
    cap = math.floor(budget * resolution * sum(w.values()) + 1e-9)
    least = sum(min(cost[b] for b in losses[u]) * w[u] for u in units)
    if least > cap:
        cheapest = min(costs[b] for u in units for b in losses[u])
        raise AllocationError(f"a budget of {budget:g} bits per element is below the cheapest allocation "
                              f"({cheapest:g}); raise --bits-per-element")
    # best[c] = least loss with weight exactly c over the units so far; choice[k][c] = width of unit k there
    inf = float("inf")
    best = [inf] * (cap + 1)
    best[0] = 0.0
    choices: list[list[int | None]] = []
    for u in units:
        nxt = [inf] * (cap + 1)
        pick: list[int | None] = [None] * (cap + 1)
        for b, loss in losses[u].items():
            dw = cost[b] * w[u]
            for c in range(cap - dw, -1, -1):
                if best[c] < inf and best[c] + loss < nxt[c + dw]:
                    nxt[c + dw] = best[c] + loss
                    pick[c + dw] = b
        best = nxt
        choices.append(pick)
    c = min(range(cap + 1), key=lambda i: (best[i], i))
    out = {}
    for k in range(len(units) - 1, -1, -1):
        b = choices[k][c]
        out[units[k]] = b
        c -= cost[b] * w[units[k]]
    return out


def allocate_scheme(sens: Sensitivity, scheme: QuantScheme, head_dim: int, n_layers: int, budget: float,
                    tokens: list[int] | None = None) -> tuple[QuantScheme, dict]:
    """The scheme with ``bits_k``/``bits_v`` (and ``split_k`` where the sensitivity measured split keys) allocated
    under ``budget`` (bits per quantized element) from measured sensitivity; layers not measured keep the base width.
    ``tokens[layer]``: the rows each layer holds at the context the budget is for (a sliding-window layer holds at
    most its window; default: equal), so the budget is met in bytes. Returns (scheme, {unit: width or SPLIT})."""
    group = scheme.group_for(head_dim)
    costs: dict = {w: w + scheme.meta_bits / group for w in sens.widths}
    if sens.split:
        costs[SPLIT] = replace(scheme, split_k=(sens.split,), bits_k=(), bits_v=()).unit_bits(0, "k", head_dim)
    layers = sorted({i for i, _ in sens.kl})
    units = [(i, kind) for i in layers for kind in KINDS]
    losses = {u: {w: sens.predicted_kl(u[0], u[1], w) for w in sens.widths} for u in units}
    for i in sens.kl_split:
        losses[(i, "k")][SPLIT] = sens.kl_split[i]
    choice = allocate(losses, {u: 1 if tokens is None else tokens[u[0]] for u in units}, costs, budget)
    bk = [scheme.bits] * n_layers
    bv = [scheme.bits] * n_layers
    split = [0] * n_layers
    for (i, kind), w in choice.items():
        if w == SPLIT:
            bk[i], split[i] = 2, sens.split
        else:
            (bk if kind == "k" else bv)[i] = w
    return replace(scheme, bits_k=tuple(bk), bits_v=tuple(bv), split_k=tuple(split) if any(split) else ()), choice
