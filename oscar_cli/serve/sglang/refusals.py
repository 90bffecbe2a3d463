"""Everything the SGLang plugin refuses at start, one line each: what is wrong and what to do.

Two kinds of checks, both pure functions (no SGLang):

* :func:`server_args_refusals` over SGLang server-argument fields (a mapping from field name to value: built from a
  live ``ServerArgs`` by :func:`server_args_view`, or from an argv by :mod:`.launch`);
* :func:`model_refusals` over the artifact's manifest and the served model's config (:class:`ModelFacts`), for this
  tensor-parallel size.

Refused: speculative decoding, HiCache (hierarchical cache) and the LMCache / FlexKV connectors, PD
disaggregation, mixed prefill+decode batches (``--enable-mixed-chunk``), a page size other than 1, a KV cache dtype
other than ``auto``, DP attention, pipeline and decode-context parallelism, two-batch overlap, PD multiplexing,
streaming sessions, prefill CUDA graphs of the ``full`` backend (``breakable``, the default, runs attention eagerly
between graph segments), another attention backend for prefill or decode, a radix cache other than
``--radix-cache-backend oscar`` (unless ``--disable-radix-cache``), a missing
``--max-running-requests`` (the exact regions are sized by it), post-capture KV sizing, a device other than CUDA;
models with MLA, sliding-window or hybrid (SWA, Mamba, linear-attention) layers; an artifact fitted for another
model (fingerprint, when the model folder has ``oscar_model.json``) or another head layout, one that leaves layers
unquantized, or whose scheme the kernels cannot run; a TP size that does not divide the KV heads (also TP > KV heads,
where SGLang replicates heads).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import OscarError
from ...models import FINGERPRINT_FILE

BACKEND = "oscar"
"""The attention backend and radix-cache backend name."""
POST_CAPTURE_ENV = "SGLANG_ENABLE_POST_CAPTURE_KV_SIZING"


class ServeRefusal(OscarError):
    """A configuration the SGLang plugin does not serve (one line: what is wrong and what to do)."""


def _set(v: Any) -> bool:
    return v not in (None, False, "", 0, "null", "none", "None")


# (field, refused(value) -> bool, message with {v} for the value)
ARG_RULES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("speculative_algorithm", _set,
     "--speculative-algorithm {v}: speculative decoding is not supported by the OSCAR backend; drop the flag"),
    ("enable_hierarchical_cache", _set,
     "--enable-hierarchical-cache: HiCache would move KV to the host without the exact regions; drop the flag"),
    ("enable_lmcache", _set, "--enable-lmcache: external KV connectors are not supported with OSCAR; drop the flag"),
    ("enable_flexkv", _set, "--enable-flexkv: external KV connectors are not supported with OSCAR; drop the flag"),
    ("disaggregation_mode", _set,
     "--disaggregation-mode {v}: PD disaggregation is not supported with OSCAR (it transfers BF16 KV); drop the flag"),
    ("enable_mixed_chunk", _set,
     "--enable-mixed-chunk: mixed prefill+decode batches are not supported with OSCAR; drop the flag"),
    ("page_size", lambda v: v is not None and int(v) != 1,
     "--page-size {v}: the OSCAR pool has token slots (page size 1); drop the flag"),
    ("kv_cache_dtype", lambda v: v not in (None, "auto"),
     "--kv-cache-dtype {v}: the OSCAR pool stores INT2 codes as the artifact's scheme says; drop the flag"),
    ("enable_dp_attention", _set, "--enable-dp-attention: DP attention is not supported with OSCAR; drop the flag"),
    ("pp_size", lambda v: v is not None and int(v) > 1,
     "--pp-size {v}: pipeline parallelism is not supported with OSCAR; use --tp-size"),
    ("dcp_size", lambda v: v is not None and int(v) > 1,
     "--dcp-size {v}: decode context parallelism is not supported with OSCAR; drop the flag"),
    ("enable_two_batch_overlap", _set,
     "--enable-two-batch-overlap: not supported with OSCAR; drop the flag"),
    ("enable_pdmux", _set, "--enable-pdmux: PD multiplexing is not supported with OSCAR; drop the flag"),
    ("enable_streaming_session", _set,
     "--enable-streaming-session: session KV bypasses the OSCAR prefix anchors; drop the flag"),
    ("cuda_graph_backend_prefill", lambda v: v == "full",
     "--cuda-graph-backend-prefill full: OSCAR's extend plans are built on the host per batch; use breakable "
     "(the default) or disabled"),
    ("prefill_attention_backend", lambda v: v not in (None, BACKEND),
     "--prefill-attention-backend {v}: prefill and decode share the INT2 pool, both must be oscar; drop the flag"),
    ("decode_attention_backend", lambda v: v not in (None, BACKEND),
     "--decode-attention-backend {v}: prefill and decode share the INT2 pool, both must be oscar; drop the flag"),
    ("max_running_requests", lambda v: v is None,
     "--max-running-requests is required with OSCAR: each running request holds (sink + recent) exact rows per "
     "layer, allocated at start; pass e.g. --max-running-requests 64"),
    ("device", lambda v: v not in (None, "cuda"),
     "--device {v}: OSCAR's Triton kernels run on CUDA; drop the flag"),
)


RADIX_FIELDS = ("radix_cache_backend", "disable_radix_cache")


def server_args_view(server_args: Any) -> dict[str, Any]:
    """The fields :data:`ARG_RULES` read, from a live SGLang ``ServerArgs`` (after ``__post_init__``)."""
    view = {field: getattr(server_args, field, None) for field in (*(f for f, _, _ in ARG_RULES), *RADIX_FIELDS)}
    cfg = getattr(server_args, "cuda_graph_config", None)
    prefill = getattr(cfg, "prefill", None)
    if getattr(prefill, "backend", None) is not None:
        view["cuda_graph_backend_prefill"] = str(prefill.backend)
    if view.get("disaggregation_mode") == "null":
        view["disaggregation_mode"] = None
    return view


def server_args_refusals(args: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> list[str]:
    """One line per refused setting in ``args`` (SGLang field name -> value; missing fields take SGLang's defaults)."""
    out = [msg.format(v=args[f]) for f, refused, msg in ARG_RULES if f in args and refused(args[f])]
    if "radix_cache_backend" in args and args["radix_cache_backend"] != BACKEND and not args.get("disable_radix_cache"):
        out.append(f"--radix-cache-backend {args['radix_cache_backend']}: the prefix cache must stop at OSCAR's anchors; "
                   f"pass --radix-cache-backend {BACKEND} (or --disable-radix-cache)")
    if "max_running_requests" not in args:
        out.append(next(m for f, _, m in ARG_RULES if f == "max_running_requests"))
    env = os.environ if environ is None else environ
    if env.get(POST_CAPTURE_ENV, "").lower() in ("1", "true", "yes"):
        out.append(f"{POST_CAPTURE_ENV}=1: post-capture KV sizing cannot resize the OSCAR pool; unset it")
    return out


# ---------------------------------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class ModelFacts:
    """What the checks need of the served model, from its HF config (``config.json`` or ``hf_config.to_dict()``)."""

    model_type: str
    num_layers: int
    num_heads: int
    kv_heads: int
    head_dim: int
    mla: bool = False
    sliding_window: bool = False
    hybrid: bool = False
    fingerprint: str | None = None
    """From ``oscar_model.json`` in the model folder, when there is one."""

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], folder: Path | None = None) -> ModelFacts:
        text = cfg.get("text_config") if isinstance(cfg.get("text_config"), Mapping) else None
        c = text or cfg
        heads = int(c["num_attention_heads"])
        kv = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
        layer_types = [str(t) for t in (c.get("layer_types") or [])]
        swa = bool(c.get("sliding_window")) and c.get("use_sliding_window", True) is not False
        swa = swa or any("sliding" in t for t in layer_types)
        hybrid = any(t not in ("full_attention", "attention", "sliding_attention") for t in layer_types) \
            or any(k in c for k in ("mamba_d_state", "ssm_state_size", "linear_num_key_heads", "full_attention_interval"))
        fp = None
        if folder is not None and (Path(folder) / FINGERPRINT_FILE).is_file():
            fp = json.loads((Path(folder) / FINGERPRINT_FILE).read_text()).get("fingerprint")
        return cls(model_type=str(c.get("model_type", cfg.get("model_type", "?"))), num_layers=int(c["num_hidden_layers"]),
                   num_heads=heads, kv_heads=kv, head_dim=head_dim, mla="kv_lora_rank" in c and c["kv_lora_rank"],
                   sliding_window=swa, hybrid=hybrid, fingerprint=fp)

    @classmethod
    def from_folder(cls, folder: Path) -> ModelFacts:
        cfg = Path(folder) / "config.json"
        if not cfg.is_file():
            raise ServeRefusal(f"{folder} has no config.json; pass a local model folder to check the artifact against")
        return cls.from_config(json.loads(cfg.read_text()), folder)


def tp_refusal(kv_heads: int, tp_size: int) -> str | None:
    """Why ``tp_size`` cannot split ``kv_heads`` by head, or None."""
    if tp_size > kv_heads:
        return (f"--tp-size {tp_size} exceeds the model's {kv_heads} KV heads (SGLang would replicate heads, OSCAR "
                f"slices the artifact by head); use a --tp-size that divides {kv_heads}")
    if kv_heads % tp_size:
        return f"--tp-size {tp_size} does not divide the model's {kv_heads} KV heads; use a divisor of {kv_heads}"
    return None


def model_refusals(manifest: Any, facts: ModelFacts, tp_size: int = 1, load_format: str | None = None
                   ) -> tuple[list[str], list[str]]:
    """(refusals, notes) for serving the artifact ``manifest`` (an ``oscar_cli.artifact.Manifest``) on ``facts``."""
    out: list[str] = []
    notes: list[str] = []
    kinds = [k for k, on in (("MLA", facts.mla), ("sliding-window", facts.sliding_window),
                             ("hybrid (Mamba / linear attention)", facts.hybrid)) if on]
    if kinds:
        out.append(f"model type {facts.model_type} has {' and '.join(kinds)} attention layers; the OSCAR backend serves "
                   "full-attention MHA/GQA models only")
    shape = manifest.shape
    want = (shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.head_dim)
    got = (facts.num_layers, facts.num_heads, facts.kv_heads, facts.head_dim)
    if want != got:
        out.append("the artifact was fitted for (layers, heads, KV heads, head dim) = "
                   f"{want}, the model has {got}; fit an artifact for this model")
    if facts.fingerprint is not None:
        if facts.fingerprint != manifest.model_fingerprint:
            out.append(f"the artifact was fitted for model fingerprint {manifest.model_fingerprint}, the model folder "
                       f"says {facts.fingerprint}; fit an artifact for this model")
        elif load_format == "dummy":
            notes.append("--load-format dummy: the folder's fingerprint matches the artifact, the weights served are "
                         "random")
    elif load_format == "dummy":
        notes.append("--load-format dummy: random weights cannot match the artifact's weight fingerprint; checked the "
                     "head layout only")
    else:
        notes.append(f"the model folder has no {FINGERPRINT_FILE}: the weight fingerprint is not checked, only the head "
                     "layout")
    missing = sorted(set(range(facts.num_layers)) - set(manifest.layers))
    if missing and want == got:
        shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
        out.append(f"the artifact leaves layer(s) {shown} unquantized; the OSCAR pool stores every layer in INT2: fit with "
                   "--layers all")
    why = manifest.scheme.kernel_support(facts.head_dim, "cuda")
    if why is not None:
        cuda_only = manifest.scheme.kernel_support(facts.head_dim) is None  # the kernels run it, not on CUDA
        sch = manifest.scheme
        if cuda_only:
            fix = "serve it with `oscar serve --engine transformers`"
        elif sch.levels != "uniform":
            fix = ("the kernels serve uniform levels (2- or 4-bit codes, fp16 or fp8 scales, keys centered or not): fit "
                   "without --levels, or serve it with `oscar serve --engine transformers`")
        else:
            fix = "fit with --bits 2 and a power-of-two group"
        out.append(f"scheme {manifest.scheme.describe()} cannot run in the kernels: {why}; {fix}")
    t = tp_refusal(facts.kv_heads, tp_size)
    if t is not None:
        out.append(t)
    return out, notes


def decode_refusal(scheme: Any, options: Any) -> str | None:
    """Why the decode ``options`` cannot read the artifact's ``scheme``, or None: the int8 variants take their
    operands from one 2-bit code plane, and an allocation's 4-bit layers have two."""
    four = [w for w in (scheme.bits, *scheme.bits_k, *scheme.bits_v) if w == 4]
    if four and not options.exact:
        return (f"decode options {options.describe()} need 2-bit codes in every layer and the scheme "
                f"{scheme.describe()} has 4-bit ones; drop the int8 options (--int8-scores, --int8-values, "
                "--decode-tuning) or fit without --bits-per-element")
    return None


def refuse(problems: list[str]) -> None:
    """Raise :class:`ServeRefusal` with the first problem (the others follow on the same line)."""
    if problems:
        more = f" (and {len(problems) - 1} more: {'; '.join(problems[1:])})" if len(problems) > 1 else ""
        raise ServeRefusal(f"oscar: {problems[0]}{more}")
