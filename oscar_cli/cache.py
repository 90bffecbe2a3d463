"""``OscarCache``: a transformers ``Cache`` holding the middle of every sequence as packed INT2 in the rotated basis.

Per layer and padded position ``j`` (rows left-padded; ``p_b`` = first real token of row ``b``):

* ``head``  — exact (model dtype), positions ``[0, min(hend, tail_start))``, ``hend = max_b p_b + sink``: the sinks;
* ``codes`` — packed rows (:func:`oscar_cli.kvquant.quantize_rows`), positions ``[qstart, tail_start)``,
  ``qstart = min_b p_b + sink``;
* ``tail``  — exact, positions ``[tail_start, n)``: the last ``recent`` tokens (plus an incomplete KIVI block).

Attention is done by the cache: ``update`` appends the new rows to the tail and returns a
:class:`~oscar_cli.attention.CachedKV` handle as keys and values (what attention reads); the registered
decode-equivalent attention (:mod:`oscar_cli.attention`) hands the query to :meth:`OscarLayer.attend`, which sees the
padding mask, attends exactly as a decoder would at every new query (so a long prefill is quantized as in serving,
not "exact prefill, quantize afterwards"), then moves tokens that left the recent rows into ``codes``. If the model
attends with anything else (``sdpa`` after a ``set_attn_implementation``, say), ``update`` refuses with one line
instead of letting attention silently cover the exact tail only.

Two backends hold the rows. The torch reference (any method: INT4, KIVI, any head dim; what CPU evaluation uses)
keeps ``head``/``codes``/``tail`` as above and dequantizes the codes it reads. The kernel backend
(:mod:`oscar_cli.cache_kernels`, the default on CUDA for INT2 per-token layers the Triton kernels cover) keeps every
quantized layer in one :class:`oscar_kernels.Int2KVPool` and attends through the fused plan/run kernels; it computes
the same attention (Design P: position-wise sink/recent rows) up to bf16 rounding of the exact rows.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, DynamicLayer

from . import attention as attn
from .cache_kernels import KernelLayer, KernelState, kernel_ready, kernels_launchable
from .config import QuantScheme
from .errors import OscarError
from .kvquant import LayerQuant, dequantize_rows, quantize_rows, quantized_count
from .methods import Method, hf_backend
from .models import attention_shape
from .quantizer import QuantizedRows, SplitRows


def _cat_rows(a, b):
    """Rows ``a`` (None: none yet) then ``b`` along the token axis: :class:`QuantizedRows` or split key rows."""
    if a is None:
        return b
    if isinstance(b, SplitRows):
        return SplitRows(_cat_rows(a.hi, b.hi), _cat_rows(a.lo, b.lo))
    mult = b.mult
    if a.mult is not None and b.mult is not None and not torch.equal(a.mult, b.mult):
        # FP8 multipliers taken from each write's rows: keep one per group from here on
        mult = torch.cat([a.mult.expand(a.scale.shape), b.mult.expand(b.scale.shape)], 2)
    return QuantizedRows(
        torch.cat([a.codes, b.codes], 2), torch.cat([a.scale, b.scale], 2), torch.cat([a.zero, b.zero], 2), b.bits,
        b.group, mult,
    )


class OscarLayer(DynamicLayer):
    """One layer of :class:`OscarCache`. ``self.keys``/``self.values`` hold the exact tail ``[B, H, n - tail_start, d]``."""

    is_croppable = False

    def __init__(self, lq: LayerQuant | None, scheme: QuantScheme, config, kernel: KernelLayer | None = None):
        super().__init__()
        self.lq, self.scheme, self.config, self.kernel = lq, scheme, config, kernel
        self.n = 0
        self.ready = False
        self.head_k = self.head_v = None
        self.codes_k: QuantizedRows | None = None
        self.codes_v: QuantizedRows | None = None
        self.tail_start = 0

    # --- transformers Cache layer API -------------------------------------------------------------------------------
    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.kernel is not None:
            self.kernel.stash(key_states, value_states)  # written into the pool by this step's attend
        else:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
        self.n += key_states.shape[-2]
        impl = getattr(self.config, "_attn_implementation", None)
        if impl != attn.ATTN_NAME:
            raise OscarError(f"the model attends with {impl!r}, but OscarCache needs the {attn.ATTN_NAME!r} attention "
                             "it installs; build the cache with make_cache() and do not switch the model's attention "
                             "implementation while the cache is in use")
        handle = attn.CachedKV(self)
        return handle, handle

    def get_seq_length(self) -> int:
        return self.n

    def reset(self) -> None:
        super().reset()
        self.n, self.ready, self.tail_start = 0, False, 0
        self.head_k = self.head_v = self.codes_k = self.codes_v = None
        if self.kernel is not None:
            self.kernel.state.reset()

    def reorder_cache(self, beam_idx):
        raise OscarError("OscarCache does not support beam search; use greedy or sampling")

    def batch_select_indices(self, indices):
        raise OscarError("OscarCache does not support dropping rows mid-generation")

    def batch_repeat_interleave(self, repeats):
        raise OscarError("OscarCache does not support expanding rows mid-generation")

    # --- storage ------------------------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes held: exact head and tail plus packed codes with their fp16 scales and zeros."""
        total = 0
        for t in (self.keys, self.values, self.head_k, self.head_v):
            if t is not None:
                total += t.numel() * t.element_size()
        for q in (self.codes_k, self.codes_v):
            if q is not None:
                total += q.nbytes
        return total

    def _pack(self, k: torch.Tensor, v: torch.Tensor) -> tuple[QuantizedRows, QuantizedRows]:
        """Seam: rotate + quantize + pack rows ``[B, H, N, d]`` (the torch reference)."""
        return quantize_rows(k, self.lq, "k"), quantize_rows(v, self.lq, "v")

    def _first_call(self, allowed: torch.Tensor) -> None:
        self.sink_end = attn.first_real(allowed) + self.scheme.sink
        self.qstart = int(self.sink_end.min())
        self.hend = int(self.sink_end.max())
        self.ready = True

    def attend(self, query: torch.Tensor, attention_mask, scaling: float) -> torch.Tensor:
        """Seam: attention of the new queries ``[B, Hq, m, d]`` over the whole cache; returns ``[B, m, Hq, d]``."""
        m, n = query.shape[2], self.n
        q_pos = torch.arange(n - m, n, device=query.device)
        if self.kernel is not None:
            def first_real():
                return attn.first_real(attn.to_bool_mask(attention_mask, query.shape[0], q_pos, n))

            return self.kernel.attend(query, first_real, n, scaling)
        allowed = attn.to_bool_mask(attention_mask, query.shape[0], q_pos, n)
        if not self.ready:
            self._first_call(allowed)
        if self.lq is None:
            return attn.mixed_attention(query, self.keys, self.values, allowed, scaling)
        lq, w, opts = self.lq, self.scheme, self.lq.decode
        qend = self.qstart + quantized_count(n, self.qstart, w.recent, lq.token_block)
        ts = self.tail_start
        # exact rows: the head [0, len_head) and the tail [ts, n); positions in between are read quantized by all rows
        k_pos = None
        if ts > 0 and self.head_k is not None:
            k_ex, v_ex = torch.cat([self.head_k, self.keys], 2), torch.cat([self.head_v, self.values], 2)
            hl = self.head_k.shape[2]
            k_pos = torch.cat([torch.arange(hl), torch.arange(ts, n)]).to(query.device)
        elif ts > 0:
            k_ex, v_ex = self.keys, self.values
            k_pos = torch.arange(ts, n, device=query.device)
        else:
            k_ex, v_ex = self.keys, self.values
        if qend <= self.qstart:
            return attn.mixed_attention(query, k_ex, v_ex, allowed, scaling, k_pos=k_pos)
        # round trips over [qstart, qend): stored codes, then rows leaving the tail now
        # (int8 scores: the INT2 rows' code and zero parts in the rotated basis, read by the int8-rounded query)
        # (int8 values: the INT2 rows' codes, scales and zeros apart, weighed as the kernel does)
        keys_of = attn.int8_keys if opts.int8_scores else (lambda rows: dequantize_rows(rows, lq, "k"))
        values_of = (lambda rows: attn.int8_value_parts(rows, lq)) if opts.int8_values else \
            (lambda rows: (dequantize_rows(rows, lq, "v"),))
        parts_k, parts_v = [], []
        if self.codes_k is not None:
            parts_k.append(keys_of(self.codes_k))
            parts_v.append(values_of(self.codes_v))
        lo = max(ts, self.qstart)
        new = None
        if qend > lo:
            new = self._pack(self.keys[:, :, lo - ts : qend - ts], self.values[:, :, lo - ts : qend - ts])
            parts_k.append(keys_of(new[0]))
            parts_v.append(values_of(new[1]))
        k_rt = torch.cat(parts_k, 2)
        v_rt = tuple(torch.cat(p, 2) for p in zip(*parts_v, strict=True))
        use = attn.rt_mask(q_pos, self.qstart, qend - self.qstart, self.sink_end, self.qstart, w.recent, lq.token_block)
        q_in = query
        if opts.int8_scores:
            q_in, k_ex = attn.int8_query(query, lq.r_k), attn.int8_exact_keys(k_ex)
        if opts.int8_values:
            out = attn.int8_values_attention(q_in, k_ex, v_ex, allowed, scaling, k_rt, v_rt, use, self.qstart,
                                             self.sink_end, k_pos).to(query.dtype)
        else:
            out = attn.mixed_attention(q_in.to(query.dtype), k_ex, v_ex, allowed, scaling, k_rt, v_rt[0], use,
                                       self.qstart, k_pos)
        if qend > ts:
            self._flush(ts, qend, new)
        return out

    def _flush(self, ts: int, qend: int, new) -> None:
        """Move tail positions ``[ts, qend)`` out: sinks to the head, the rest (already packed) to the codes."""
        head_hi = min(qend, self.hend)
        if head_hi > ts:
            hk, hv = self.keys[:, :, : head_hi - ts], self.values[:, :, : head_hi - ts]
            self.head_k = hk.clone() if self.head_k is None else torch.cat([self.head_k, hk], 2)
            self.head_v = hv.clone() if self.head_v is None else torch.cat([self.head_v, hv], 2)
        if new is not None:
            self.codes_k = _cat_rows(self.codes_k, new[0])
            self.codes_v = _cat_rows(self.codes_v, new[1])
        self.keys = self.keys[:, :, qend - ts :].clone()
        self.values = self.values[:, :, qend - ts :].clone()
        self.tail_start = qend


BACKENDS = ("auto", "reference", "kernels")


class OscarCache(Cache):
    """INT2 (or INT4) KV cache with exact sink and recent rows. Build with :func:`make_cache`.

    ``quants``: one :class:`LayerQuant` per layer (None = exact layer); ``scheme``: the quant scheme (its sink and
    recent rows; the bits and group are the quantizers'). ``backend``: ``auto`` (the kernels on CUDA when every
    quantized layer is one they cover, else the torch reference), ``reference``, or ``kernels`` (refused with one line
    naming the layer and the reason when they do not cover it; on CPU it needs ``TRITON_INTERPRET=1``). Sliding-window
    layers (gemma-3's) stay with the reference, which reads the window from the attention mask."""

    def __init__(self, model, quants: list[LayerQuant | None], scheme: QuantScheme, backend: str = "auto"):
        attn.ensure_installed(model)
        if backend not in BACKENDS:
            raise OscarError(f"unknown cache backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        dev = next(model.parameters()).device
        cfg = model.config
        d = attention_shape(cfg).head_dim
        why = {i: kernel_ready(q, scheme, d, dev.type) for i, q in enumerate(quants) if q is not None}
        types = getattr(cfg, "layer_types", None) or []
        for i in why:
            if not why[i] and i < len(types) and types[i] == "sliding_attention" and getattr(cfg, "sliding_window", 0):
                why[i] = "a sliding-window layer (the kernels read every cached row of a sequence, not its window)"
        if backend == "kernels" and any(why.values()):
            i = next(i for i, w in why.items() if w)
            raise OscarError(f"the kernel cache backend cannot run layer {i}: {why[i]}; use backend='reference'")
        if backend == "kernels" and not kernels_launchable(dev):
            raise OscarError(f"the kernel cache backend runs on CUDA tensors and the model is on {dev}; move it to "
                             "CUDA, use backend='reference', or set TRITON_INTERPRET=1 before triton loads")
        use_kernels = bool(why) and not any(why.values()) and (backend == "kernels" or
                                                                (backend == "auto" and dev.type == "cuda"))
        self.kernel_state = KernelState({i: quants[i] for i in why}, scheme, cfg) if use_kernels else None
        layers = []
        for i, q in enumerate(quants):
            kernel = KernelLayer(i, self.kernel_state) if use_kernels and q is not None else None
            layers.append(OscarLayer(None if q is None else q.to(dev), scheme, cfg, kernel))
        super().__init__(layers=layers)
        self.scheme = scheme

    @property
    def backend(self) -> str:
        return "kernels" if self.kernel_state is not None else "reference"

    def nbytes(self) -> int:
        """Bytes held by all layers (what the cache costs in memory; the kernel backend's pool as allocated)."""
        pool = self.kernel_state.nbytes if self.kernel_state is not None else 0
        return pool + sum(layer.nbytes() for layer in self.layers)

    def elements(self) -> int:
        """K and V elements represented (padded positions included)."""
        total = 0
        for layer in self.layers:
            if layer.keys is not None:
                b, h, _, d = layer.keys.shape
                total += 2 * b * h * layer.n * d
        return total

    def bits_per_element(self) -> float:
        return self.nbytes() * 8 / max(1, self.elements())


def make_cache(model, method: Method, quants: list[LayerQuant | None] | None, scheme: QuantScheme,
               backend: str = "auto"):
    """A fresh cache for one generation: :class:`OscarCache` for quantizing methods and ``bf16``, transformers'
    ``QuantizedCache`` (2 bits, group 64, residual ``scheme.recent``) for ``hf-*`` peers."""
    if method.family == "hf":
        from transformers import QuantizedCache

        backend = hf_backend(method)
        kw = dict(backend=backend, config=model.config, nbits=method.bits, q_group_size=64,
                  residual_length=scheme.recent)
        try:
            return QuantizedCache(**kw)
        except TypeError:  # pragma: no cover  (older signature)
            kw.pop("config")
            return QuantizedCache(**kw)
    n_layers = model.config.num_hidden_layers
    return OscarCache(model, quants if quants is not None else [None] * n_layers, scheme, backend)


def cache_kwarg(model) -> str:
    """The keyword that passes a cache to ``generate``/``forward``: ``cache`` (transformers >= 5.24) or
    ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
