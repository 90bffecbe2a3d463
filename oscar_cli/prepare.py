"""A model in one KV method's state: what evaluation and the embedded server both start from.

:func:`prepare` switches a model to a :class:`~oscar_cli.methods.Method` at the
:class:`~oscar_kernels.scheme.QuantScheme` it runs with (:func:`oscar_cli.methods.scheme_for`): exact methods and
``hf-*`` peers attend with plain SDPA; quantizing methods get their per-layer quantizers
(:func:`oscar_cli.kvquant.build_layer_quants`) and the decode-equivalent attention (:mod:`oscar_cli.attention`), which
scores teacher-forced exactly as a decoder holding that cache would. :func:`element_bits` is what the method's cache
costs per K/V element.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import attention
from .config import QuantScheme
from .kvquant import bits_per_element, build_layer_quants
from .methods import Method, hf_backend
from .models import attention_shape, layer_tokens

__all__ = ["Prepared", "element_bits", "head_dim_of", "prepare"]


@dataclass(frozen=True)
class Prepared:
    """A model in one method's state. ``scheme``: what the method runs with; ``quants``: per-layer quantizers (None
    for exact/peer methods); ``artifact``: the artifact's name for artifact methods."""

    method: Method
    scheme: QuantScheme
    quants: list | None
    artifact: str | None

    @property
    def layers_quantized(self) -> int:
        return 0 if self.quants is None else sum(q is not None for q in self.quants)


def head_dim_of(config) -> int:
    """The attention head dim of a model config."""
    return attention_shape(config).head_dim


def _set_sdpa(model) -> None:
    try:
        model.set_attn_implementation("sdpa")
    except Exception:  # noqa: BLE001
        model.config._attn_implementation = "sdpa"


def prepare(model, method: Method, scheme: QuantScheme, artifact=None) -> Prepared:
    """Switch ``model`` to ``method`` at ``scheme`` (see :func:`oscar_cli.methods.scheme_for`), with an
    :class:`oscar_cli.artifact.Artifact` for artifact methods."""
    art_name = artifact.name if artifact is not None and method.needs_artifact else None
    if method.family in ("exact", "hf"):
        if method.family == "hf":
            hf_backend(method)  # a clear error now, not mid-run
        _set_sdpa(model)
        return Prepared(method, scheme, None, art_name)
    cfg = model.config
    quants = build_layer_quants(method, scheme, cfg.num_hidden_layers, head_dim_of(cfg), cfg.num_key_value_heads,
                                artifact)
    attention.install(model, quants, scheme)
    return Prepared(method, scheme, quants, art_name)


def element_bits(prep: Prepared, model, seq_len: int, exact_bits: int = 16) -> float:
    """Storage bits per K/V element at ``seq_len`` tokens with BF16 exact rows (see
    :func:`oscar_cli.kvquant.bits_per_element`). ``hf-*`` peers: 2-bit codes, fp scale+zero per 64, BF16 residual."""
    cfg = model.config
    m = prep.method
    if m.family == "hf":
        # QuantizedCache flushes its whole residual when it reaches `recent` tokens: on average recent/2 exact
        nq = max(0, seq_len - prep.scheme.recent // 2)
        return (nq * (m.bits + 2 * exact_bits / 64) + (seq_len - nq) * exact_bits) / seq_len
    return bits_per_element(m, prep.scheme, seq_len, head_dim_of(cfg),
                            layers_quantized=prep.layers_quantized if m.family == "quant" else None,
                            n_layers=cfg.num_hidden_layers, exact_bits=exact_bits,
                            quantized_layers=None if prep.quants is None else
                            [i for i, q in enumerate(prep.quants) if q is not None],
                            tokens=layer_tokens(cfg, seq_len))
