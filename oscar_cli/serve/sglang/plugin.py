"""The SGLang-facing side of the plugin: registration, hooks, and the three classes SGLang instantiates.

Runs only inside SGLang's processes; every SGLang import happens inside a function, and every class that subclasses
an SGLang type is built by a function (:func:`pool_class`, :func:`backend_class`, :func:`radix_cache_class`), so the
rest of the package imports without SGLang. The design is in :mod:`oscar_cli.serve.sglang`; the symbols touched are
listed in :mod:`.targets`.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from . import targets as T
from .core import OscarAttention, OscarKV
from .refusals import BACKEND, ModelFacts, ServeRefusal, refuse, server_args_refusals, server_args_view
from .settings import CHANNEL_KEY, read_settings
from .setup import RankSetup, load_checked_artifact, rank_setup

log = logging.getLogger(__name__)

TARGET_PROBLEMS: list[str] = []
"""Registry targets that the running SGLang does not have as registered (filled by :func:`install`)."""


def selected(server_args: Any) -> bool:
    """Whether this server runs the OSCAR backend (the only case any hook does anything)."""
    return getattr(server_args, "attention_backend", None) == BACKEND


# ---------------------------------------------------------------------------------------------------- registration
def install() -> None:
    """``register()``: the backend name, its factory, the radix-cache backend and four pass-through hooks."""
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    TARGET_PROBLEMS[:] = T.check_live([*T.HOOKS, T.ADD_BACKEND_CHOICES, T.REGISTER_BACKEND, T.REGISTER_RADIX,
                                       T.REGISTERED_RADIX, T.HOOK_REGISTER])
    for p in TARGET_PROBLEMS:
        log.error("oscar: SGLang target changed: %s", p)
    if BACKEND not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND])
    register_attention_backend(BACKEND)(create_backend)
    if BACKEND not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND, create_radix_cache)
    HookRegistry.register(T.HOOK_CHECK_ARGS.path, after_check_server_args, HookType.AFTER)
    HookRegistry.register(T.HOOK_AVAILABLE_BYTES.path, around_available_bytes, HookType.AROUND)
    HookRegistry.register(T.HOOK_CELL_SIZE.path, around_cell_size, HookType.AROUND)
    HookRegistry.register(T.HOOK_BUILD_POOL.path, around_build_pool, HookType.AROUND)


def launcher_refusals(server_args: Any) -> list[str]:
    """Everything checkable from the server arguments alone (also without a GPU)."""
    problems = [f"the installed SGLang does not match the plugin (written for {T.SGLANG_VERSION}): {p}"
                for p in TARGET_PROBLEMS]
    problems += server_args_refusals(server_args_view(server_args))
    if read_settings(getattr(server_args, "json_model_override_args", None)) is None:
        problems.append(f'--json-model-override-args has no "{CHANNEL_KEY}" entry naming the artifact; start the '
                        "server through `oscar serve --engine sglang` (or see oscar_cli.serve.sglang.launch)")
    return problems


def after_check_server_args(result: Any, server_args: Any) -> None:
    """AFTER ``ServerArgs.check_server_args`` (the launcher, before any process starts): one-line refusals, and the
    artifact checked against a local model folder."""
    if not selected(server_args):
        return None
    refuse(launcher_refusals(server_args))
    folder = Path(server_args.model_path)
    if folder.is_dir():
        settings = read_settings(server_args.json_model_override_args)
        _, notes = load_checked_artifact(settings, ModelFacts.from_folder(folder), int(server_args.tp_size),
                                         server_args.load_format)
        for n in notes:
            log.warning("oscar: %s", n)
    return None


# ---------------------------------------------------------------------------------------------------- memory hooks
def _pool_selected(kvc: Any) -> bool:
    return selected(kvc.server_args) and not kvc.is_draft_worker


def max_extend_tokens(server_args: Any, context_len: int) -> int:
    """Upper bound of new tokens in one extend batch: the prefill token budget, the chunk size (the context length
    when chunking is off) and the largest prefill CUDA-graph capture size."""
    chunk = getattr(server_args, "chunked_prefill_size", None)
    bounds = [int(getattr(server_args, "max_prefill_tokens", 0) or 0),
              int(chunk) if chunk and int(chunk) > 0 else int(context_len)]
    graph = getattr(getattr(getattr(server_args, "cuda_graph_config", None), "prefill", None), "bs", None)
    if graph:
        bounds.append(max(int(x) for x in graph))
    return max(bounds)


@functools.lru_cache(maxsize=4)
def _setup_for(artifact: str, model_path: str, tp_size: int, tp_rank: int, start_layer: int, num_layers: int,
               request_slots: int, max_tokens: int, max_seq_len: int, hf_config: str, load_format: str | None,
               override: str) -> RankSetup:
    import json

    settings = read_settings(override)
    folder = Path(model_path) if Path(model_path).is_dir() else None
    facts = ModelFacts.from_config(json.loads(hf_config), folder)
    art, notes = load_checked_artifact(settings, facts, tp_size, load_format)
    setup = rank_setup(settings, art, facts, tp_size=tp_size, tp_rank=tp_rank, request_slots=request_slots,
                       max_tokens=max_tokens, max_seq_len=max_seq_len, start_layer=start_layer,
                       num_layers=num_layers, notes=tuple(notes))
    log.info("oscar: rank %d/%d, layers %d..%d, %d KV heads, scheme %s: %s", tp_rank, tp_size, start_layer,
             start_layer + num_layers - 1, setup.kv_heads, setup.scheme.describe(), setup.budget.describe())
    return setup


def rank_setup_of(kvc: Any) -> RankSetup:
    """The :class:`~.setup.RankSetup` of the rank a ``KVCacheConfigurator`` configures (built once per process)."""
    import json

    from sglang.srt.mem_cache.allocation_sizing import get_req_to_token_extra_context_len

    sa, mc = kvc.server_args, kvc.model_config
    if sa.max_running_requests is None:
        refuse(server_args_refusals({"max_running_requests": None}))
    settings = read_settings(sa.json_model_override_args)
    if settings is None:
        refuse(launcher_refusals(sa))
    context = int(mc.context_len)
    return _setup_for(str(settings.artifact), str(sa.model_path), int(kvc.ps.attn_tp_size), int(kvc.ps.attn_tp_rank),
                      int(kvc.layer_info.start_layer), int(kvc.layer_info.num_effective_layers),
                      int(sa.max_running_requests) + 1, max_extend_tokens(sa, context),
                      context + int(get_req_to_token_extra_context_len(sa)),
                      json.dumps(mc.hf_config.to_dict(), sort_keys=True, default=str), sa.load_format,
                      sa.json_model_override_args)


def around_available_bytes(original, kvc, pre_model_load_memory):
    """AROUND ``KVCacheConfigurator._profile_available_bytes``: the KV budget minus OSCAR's fixed bytes."""
    available = original(kvc, pre_model_load_memory)
    if not _pool_selected(kvc):
        return available
    fixed = rank_setup_of(kvc).budget.fixed
    if available <= fixed:
        refuse([f"the OSCAR fixed memory ({fixed / 2**30:.2f} GiB: exact regions, anchors, plan workspaces) exceeds "
                f"the KV budget ({available / 2**30:.2f} GiB); lower --max-running-requests or the anchors, or raise "
                "--mem-fraction-static"])
    return available - fixed


def around_cell_size(original, configurator, kvc, num_layers):
    """AROUND ``DefaultPoolConfigurator._compute_cell_size``: INT2 bytes per token for this rank."""
    if not _pool_selected(kvc):
        return original(configurator, kvc, num_layers)
    setup = rank_setup_of(kvc)
    if num_layers != setup.num_layers:
        refuse([f"SGLang sizes {num_layers} KV layers, the OSCAR pool {setup.num_layers}"])
    return setup.budget.cell


def around_build_pool(original, kvc, *, max_total_num_tokens, mha_pool_class, quant_method=None):
    """AROUND ``KVCacheConfigurator._build_mha_kv_pool``: the OSCAR pool instead of ``MHATokenToKVPool``."""
    if not _pool_selected(kvc):
        return original(kvc, max_total_num_tokens=max_total_num_tokens, mha_pool_class=mha_pool_class,
                        quant_method=quant_method)
    return pool_class()(kvc, rank_setup_of(kvc), max_total_num_tokens)


# ---------------------------------------------------------------------------------------------------- the classes
@functools.cache
def pool_class():
    """``OscarTokenToKVPool(KVCache)``: SGLang's view of one rank's :class:`~.core.OscarKV`."""
    from sglang.srt.mem_cache.memory_pool import KVCache

    class OscarTokenToKVPool(KVCache):
        """Token slots ``1 .. size`` hold INT2 codes (slot 0 pads CUDA graphs); the exact regions, anchors and
        plans live in ``self.oscar``. Only the oscar attention backend reads or writes it."""

        def __init__(self, kvc: Any, setup: RankSetup, size: int):
            page = 1
            super().__init__(size, page, kvc.kv_cache_dtype, setup.num_layers, kvc.device, False,
                             setup.start_layer, setup.start_layer + setup.num_layers - 1, "OSCAR INT2")
            self.head_num, self.head_dim, self.v_head_dim = setup.kv_heads, setup.head_dim, setup.head_dim
            self.setup = setup
            self.oscar = OscarKV(setup.scheme, setup.num_layers, setup.kv_heads, setup.head_dim, size + page,
                                 setup.request_slots, setup.rot_k, setup.rot_v, setup.clip_k, setup.clip_v,
                                 setup.settings.anchors, setup.settings.anchor_interval, device=kvc.device,
                                 finish_anchors=bool(kvc.server_args.disable_overlap_schedule),
                                 mult_k=setup.mult_k, mult_v=setup.mult_v, start_layer=setup.start_layer,
                                 center_k=setup.center_k)
            self._finalize_allocation_log(size)

        def get_kv_size_bytes(self):
            n = self.oscar.pool.nbytes
            return n // 2, n - n // 2

        def _no_buffers(self, *args, **kwargs):
            raise RuntimeError("the OSCAR pool has no BF16 K/V buffers: only --attention-backend oscar reads or "
                               "writes it")

        get_key_buffer = get_value_buffer = get_kv_buffer = set_kv_buffer = _no_buffers
        get_cpu_copy = load_cpu_copy = move_kv_cache = _no_buffers

    return OscarTokenToKVPool


def layer_facts(model: Any) -> list[Any]:
    """The model's attention layers (SGLang ``RadixAttention``: objects with ``layer_id`` and ``scaling``)."""
    return [m for m in model.modules() if hasattr(m, "layer_id") and hasattr(m, "scaling") and hasattr(m, "tp_k_head_num")]


def check_layers(layers: list[Any], setup: RankSetup) -> float:
    """Refuse layers the kernels cannot run; returns the one softmax scale they share."""
    problems = []
    for m in layers:
        if getattr(m, "logit_cap", 0) or (getattr(m, "sliding_window_size", -1) or -1) > -1:
            problems.append(f"layer {m.layer_id} uses a logit cap or a sliding window; OSCAR serves plain causal "
                            "attention")
        if (m.tp_q_head_num, m.tp_k_head_num, m.qk_head_dim, m.v_head_dim) != \
                (setup.q_heads, setup.kv_heads, setup.head_dim, setup.head_dim):
            problems.append(f"layer {m.layer_id} has (q heads, KV heads, qk dim, v dim) = "
                            f"{(m.tp_q_head_num, m.tp_k_head_num, m.qk_head_dim, m.v_head_dim)} on this rank, the "
                            f"artifact {(setup.q_heads, setup.kv_heads, setup.head_dim, setup.head_dim)}")
    scales = sorted({float(m.scaling) for m in layers})
    if len(scales) > 1:
        problems.append(f"the layers use {len(scales)} softmax scales; OSCAR's plans take one")
    refuse(problems)
    return scales[0] if scales else None


@functools.cache
def backend_class():
    """``OscarAttnBackend(AttentionBackend)``: metadata through the plans, attention through their runs."""
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    class OscarAttnBackend(AttentionBackend):
        needs_cpu_seq_lens = False

        def __init__(self, model_runner: Any):
            super().__init__()
            pool = model_runner.token_to_kv_pool
            if not hasattr(pool, "oscar"):
                refuse(["the OSCAR KV pool was not built (its hook on KVCacheConfigurator._build_mha_kv_pool did not "
                        "apply: look for 'Failed to apply hooks' above); set SGLANG_PLUGINS=oscar"])
            setup: RankSetup = pool.setup
            rtp = model_runner.req_to_token_pool
            sm_scale = check_layers(layer_facts(model_runner.model), setup)
            sa = model_runner.server_args
            self.setup = setup
            self.core = OscarAttention(pool.oscar, rtp.req_to_token, max_batch=rtp.req_to_token.shape[0],
                                       max_tokens=max_extend_tokens(sa, model_runner.model_config.context_len),
                                       q_heads=setup.q_heads, sm_scale=sm_scale, options=setup.settings.decode)

        # metadata ---------------------------------------------------------------------------------------------
        def init_forward_metadata(self, forward_batch):
            mode = forward_batch.forward_mode
            if mode.is_idle():
                return
            if mode.is_decode_or_idle():
                self.core.plan_decode(forward_batch.req_pool_indices, forward_batch.seq_lens,
                                      forward_batch.out_cache_loc)
            elif getattr(mode, "name", "") == "EXTEND":
                prefix = forward_batch.extend_prefix_lens_cpu
                ext = forward_batch.extend_seq_lens_cpu
                if prefix is None or ext is None:  # SGLang's device-only batches (speculative paths, refused)
                    prefix, ext = forward_batch.extend_prefix_lens.tolist(), forward_batch.extend_seq_lens.tolist()
                self.core.plan_extend(forward_batch.req_pool_indices, forward_batch.extend_prefix_lens,
                                      forward_batch.extend_seq_lens, forward_batch.out_cache_loc, prefix, ext,
                                      getattr(forward_batch, "rids", None))
            else:
                raise ServeRefusal(f"oscar: forward mode {getattr(mode, 'name', mode)} is not supported")

        def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
            # decode CUDA graphs: before capture (in_capture=True) and eagerly before every replay, with the padded
            # batch view (requests [:bs], live out_cache_loc [:raw_bs]); the captured run reads the plan's buffers
            self.init_forward_metadata(forward_batch)

        def init_cuda_graph_state(self, max_bs, max_num_tokens):
            if max_bs > self.core.decode.max_batch:
                refuse([f"decode CUDA graphs up to batch {max_bs} exceed the request table ({self.core.decode.max_batch}"
                        " rows); lower --cuda-graph-max-bs-decode"])

        def get_cuda_graph_seq_len_fill_value(self):
            return 1

        # attention ---------------------------------------------------------------------------------------------
        def _shapes(self, q, k, v, save_kv_cache, kwargs):
            extra = [name for name, val in kwargs.items() if val is not None]
            if not save_kv_cache or k is None or extra:
                raise ServeRefusal(f"oscar: attention called with save_kv_cache={save_kv_cache}, k={k is not None}, "
                                   f"extras {extra}; OSCAR writes every new token's K/V itself")
            s = self.setup
            return (q.reshape(-1, s.q_heads, s.head_dim), k.reshape(-1, s.kv_heads, s.head_dim),
                    v.reshape(-1, s.kv_heads, s.head_dim))

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            q3, k3, v3 = self._shapes(q, k, v, save_kv_cache, kwargs)
            out = self.core.forward_decode(layer.layer_id - self.setup.start_layer, q3, k3, v3)
            return out.reshape(q3.shape[0], -1)

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            q3, k3, v3 = self._shapes(q, k, v, save_kv_cache, kwargs)
            out = self.core.forward_extend(layer.layer_id - self.setup.start_layer, q3, k3, v3)
            return out.reshape(q3.shape[0], -1)

    return OscarAttnBackend


def create_backend(model_runner: Any):
    """``--attention-backend oscar`` (registered in SGLang's attention registry)."""
    return backend_class()(model_runner)


@functools.cache
def radix_cache_class():
    """``OscarRadixCache(RadixCache)``: matches stop at anchors; request ends take anchors and release pins."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    class OscarRadixCache(RadixCache):
        def __init__(self, params: Any, oscar: OscarKV):
            super().__init__(params)
            self.oscar = oscar

        def match_prefix(self, params):
            result = super().match_prefix(params)
            req = getattr(params, "req", None)
            if req is None or self.disable:  # SGLang's own re-match after an insert: never capped
                return result
            a, entry = self.oscar.table.deepest(result.device_indices)
            self.oscar.table.pin(req.rid, entry if a > 0 else None)
            if a == len(result.device_indices):
                return result
            key = params.key
            capped = RadixKey(key.token_ids, key.extra_key, is_bigram=key.is_bigram, limit=a)
            return super().match_prefix(MatchPrefixParams(key=capped, cow_mamba=params.cow_mamba, req=req))

        def cache_unfinished_req(self, req, chunked=False):
            super().cache_unfinished_req(req, chunked=chunked)
            self.oscar.table.unpin(req.rid)

        def cache_finished_req(self, req, is_insert=True, *, kv_len_to_handle):
            rid_slot, a = req.req_pool_idx, kv_len_to_handle
            inserting = is_insert and not self.disable and not self.disable_finished_insert
            super().cache_finished_req(req, is_insert=is_insert, kv_len_to_handle=kv_len_to_handle)
            exact = self.oscar.region_pos.get(req.rid) is not None and req.kv_committed_len == a
            self.oscar.finished(req.rid)
            if self.oscar.finish_anchors and inserting and exact and a > 0 and rid_slot is not None:
                token_ids = (req.origin_input_ids + req.output_ids)[:a]
                m = super().match_prefix(MatchPrefixParams(key=RadixKey(token_ids, req.extra_key)))
                if len(m.device_indices) >= a:
                    self.oscar.snapshot(int(rid_slot), a, m.device_indices[a - 1:a])

    return OscarRadixCache


def create_radix_cache(ctx: Any):
    """``--radix-cache-backend oscar`` (registered in SGLang's radix-cache registry)."""
    from sglang.srt.mem_cache.registry import default_radix_cache_factory

    allocator = ctx.params.token_to_kv_pool_allocator
    oscar = getattr(allocator.get_kvcache(), "oscar", None) if allocator is not None else None
    if oscar is None:
        refuse(["--radix-cache-backend oscar needs --attention-backend oscar (its anchors live in the OSCAR pool)"])
    if ctx.disable_radix_cache or ctx.params.disable:
        return default_radix_cache_factory(ctx)
    return radix_cache_class()(ctx.params, oscar)
