"""Every SGLang symbol the plugin touches, in one registry, and the checks that hold them to SGLang's source.

Each :class:`Target` names a module, a qualified name inside it and what the plugin relies on:

* ``kind="function"``: a function or method whose parameter list must be exactly ``params`` (names in order;
  ``"*"`` marks the start of keyword-only parameters, ``"*args"``/``"**kwargs"`` the variadic ones);
* ``kind="class"``: a class that must exist (the plugin subclasses or instantiates it);
* ``kind="fields"``: a class that must assign every name in ``fields`` (dataclass fields, or ``self.<name> = ...``
  anywhere in the class body): attributes the plugin reads.

:func:`check_source` reads a source tree (the unpacked or zipped 0.5.17 wheel) with :mod:`ast`, without importing
it: a renamed or re-signatured target is a problem line. :func:`check_live` does the same on imported objects
(``inspect``) and runs inside SGLang's processes at ``register()``: hook failures in SGLang's HookRegistry are only
logged, so the plugin checks its targets itself.

Pure standard library: importable anywhere.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

SGLANG_VERSION = "0.5.17"
"""The release the registry was written against (its torch pin matches the H200 image, see the module docstring
of :mod:`oscar_cli.serve.sglang`)."""


@dataclass(frozen=True)
class Target:
    module: str
    qualname: str
    kind: str
    params: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()
    why: str = ""

    @property
    def path(self) -> str:
        """Dotted path as SGLang's ``HookRegistry.register`` takes it."""
        return f"{self.module}.{self.qualname}"


def _fn(module: str, qualname: str, params: str, why: str) -> Target:
    return Target(module, qualname, "function", tuple(p.strip() for p in params.split(",") if p.strip()), why=why)


def _cls(module: str, qualname: str, why: str) -> Target:
    return Target(module, qualname, "class", why=why)


def _fields(module: str, qualname: str, fields: str, why: str) -> Target:
    return Target(module, qualname, "fields", fields=tuple(f.strip() for f in fields.split(",") if f.strip()), why=why)


_SA = "sglang.srt.server_args"
_REG = "sglang.srt.layers.attention.attention_registry"
_BASE = "sglang.srt.layers.attention.base_attn_backend"
_KVC = "sglang.srt.mem_cache.kv_cache_configurator"
_POOLCFG = "sglang.srt.model_executor.pool_configurator"
_MEM = "sglang.srt.mem_cache.memory_pool"
_RADIX = "sglang.srt.mem_cache.radix_cache"
_BPC = "sglang.srt.mem_cache.base_prefix_cache"
_RREG = "sglang.srt.mem_cache.registry"
_HOOK = "sglang.srt.plugins.hook_registry"
_FB = "sglang.srt.model_executor.forward_batch_info"

# ---- hooks (HookRegistry targets) --------------------------------------------------------------------------------
HOOK_CHECK_ARGS = _fn(_SA, "ServerArgs.check_server_args", "self",
                      "AFTER hook: the launcher's one-line refusals, before any process is spawned")
HOOK_BUILD_POOL = _fn(_KVC, "KVCacheConfigurator._build_mha_kv_pool",
                      "self, *, max_total_num_tokens, mha_pool_class, quant_method",
                      "AROUND hook: build the OSCAR pool instead of MHATokenToKVPool")
HOOK_AVAILABLE_BYTES = _fn(_KVC, "KVCacheConfigurator._profile_available_bytes", "self, pre_model_load_memory",
                           "AROUND hook: subtract the fixed overhead (exact regions, anchors, plan workspaces)")
HOOK_CELL_SIZE = _fn(_POOLCFG, "DefaultPoolConfigurator._compute_cell_size", "self, kvc, num_layers",
                     "AROUND hook: INT2 bytes per token instead of BF16 K+V")
HOOKS = (HOOK_CHECK_ARGS, HOOK_BUILD_POOL, HOOK_AVAILABLE_BYTES, HOOK_CELL_SIZE)

# ---- registration APIs ---------------------------------------------------------------------------------------------
ADD_BACKEND_CHOICES = _fn(_SA, "add_attention_backend_choices", "choices", "make --attention-backend oscar parse")
REGISTER_BACKEND = _fn(_REG, "register_attention_backend", "name", "register the backend factory")
REGISTER_RADIX = _fn(_RREG, "register_radix_cache_backend", "name, factory", "--radix-cache-backend oscar")
REGISTERED_RADIX = _fn(_RREG, "registered_radix_cache_backends", "", "idempotent registration")
DEFAULT_RADIX_FACTORY = _fn(_RREG, "default_radix_cache_factory", "ctx",
                            "fall back to SGLang's own cache when the radix cache is disabled")
HOOK_REGISTER = _fn(_HOOK, "HookRegistry.register", "cls, target, hook, hook_type, *, source", "register the hooks")
HOOK_TYPE = _fields(_HOOK, "HookType", "AROUND, AFTER", "hook kinds used")

# ---- classes the plugin subclasses, and the methods it overrides -------------------------------------------------
ATTENTION_BACKEND = _cls(_BASE, "AttentionBackend", "base class of the OSCAR backend")
BACKEND_METHODS = (
    _fn(_BASE, "AttentionBackend.init_forward_metadata", "self, forward_batch", "eager metadata (extend, decode)"),
    _fn(_BASE, "AttentionBackend.init_forward_metadata_out_graph", "self, forward_batch, in_capture",
        "decode CUDA graphs: called before capture (in_capture=True) and before every replay"),
    _fn(_BASE, "AttentionBackend.init_forward_metadata_in_graph", "self, forward_batch",
        "recorded inside the graph (kept the base no-op)"),
    _fn(_BASE, "AttentionBackend.init_cuda_graph_state", "self, max_bs, max_num_tokens",
        "called once by the decode graph runner"),
    _fn(_BASE, "AttentionBackend.get_cuda_graph_seq_len_fill_value", "self", "seq len of padded graph rows"),
    _fn(_BASE, "AttentionBackend.forward_decode",
        "self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs", "decode attention"),
    _fn(_BASE, "AttentionBackend.forward_extend",
        "self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs", "extend attention"),
)
KV_CACHE = _fn(_MEM, "KVCache.__init__",
               "self, size, page_size, dtype, layer_num, device, enable_memory_saver, start_layer, end_layer, "
               "allocation_label", "base class of the OSCAR pool")
KV_CACHE_METHODS = (
    _fn(_MEM, "KVCache.get_key_buffer", "self, layer_id", "abstract: refused for OSCAR"),
    _fn(_MEM, "KVCache.get_value_buffer", "self, layer_id", "abstract: refused for OSCAR"),
    _fn(_MEM, "KVCache.get_kv_buffer", "self, layer_id", "abstract: refused for OSCAR"),
    _fn(_MEM, "KVCache.set_kv_buffer", "self, layer, loc, cache_k, cache_v", "abstract: refused for OSCAR"),
    _fn(_MEM, "KVCache._finalize_allocation_log", "self, num_tokens", "logs get_kv_size_bytes, sets mem_usage"),
)
RADIX_CACHE = _fn(_RADIX, "RadixCache.__init__", "self, params", "base class of the OSCAR radix cache")
RADIX_METHODS = (
    _fn(_RADIX, "RadixCache.match_prefix", "self, params", "capped to the deepest anchor"),
    _fn(_RADIX, "RadixCache.cache_finished_req", "self, req, is_insert, *, kv_len_to_handle",
        "anchor at the end of a finished request, end of the request's bookkeeping"),
    _fn(_RADIX, "RadixCache.cache_unfinished_req", "self, req, chunked", "a request's extend has run: unpin"),
)
RADIX_KEY = _fn(_RADIX, "RadixKey.__init__", "self, token_ids, extra_key, is_bigram, limit", "capped match keys")
MATCH_PARAMS = _fields(_BPC, "MatchPrefixParams", "key, cow_mamba, req", "match parameters (req: whose match)")
CACHE_PARAMS = _fields("sglang.srt.mem_cache.cache_init_params", "CacheInitParams",
                      "disable, req_to_token_pool, token_to_kv_pool_allocator, disable_finished_insert",
                      "radix cache construction")
ALLOCATOR_GET_KVCACHE = _fn("sglang.srt.mem_cache.allocator.base", "BaseTokenToKVPoolAllocator.get_kvcache", "self",
                            "the radix cache finds the OSCAR pool through the allocator")
EXTRA_CONTEXT_LEN = _fn("sglang.srt.mem_cache.allocation_sizing", "get_req_to_token_extra_context_len",
                        "server_args", "req_to_token row width = context_len + this (the plans' max_seq_len)")
TREE_CONTEXT = _fields(_RREG, "TreeCacheBuildContext", "server_args, params, tp_worker, disable_radix_cache",
                       "radix cache factory input")

# ---- attributes read -------------------------------------------------------------------------------------------------
FORWARD_BATCH = _fields(_FB, "ForwardBatch",
                        "forward_mode, batch_size, req_pool_indices, seq_lens, out_cache_loc, extend_prefix_lens_cpu, "
                        "extend_seq_lens_cpu, extend_prefix_lens, extend_seq_lens, rids",
                        "what the metadata is built from")
FORWARD_MODE = (
    _fn(_FB, "ForwardMode.is_decode_or_idle", "self", "decode metadata"),
    _fn(_FB, "ForwardMode.is_idle", "self", "idle batches"),
    _fn(_FB, "ForwardMode.is_extend", "self, include_draft_extend_v2", "extend metadata"),
)
KV_CONFIGURATOR = _fields(_KVC, "KVCacheConfigurator",
                          "device, ps, model_config, server_args, kv_cache_dtype, model_dtype, is_draft_worker, "
                          "layer_info",
                          "the pool hooks read these")
LAYER_INFO = _fields("sglang.srt.model_executor.model_runner_components.layer_setup", "ModelLayerInfo",
                     "start_layer, end_layer, num_effective_layers", "this rank's layers")
PARALLEL_STATE = _fields("sglang.srt.distributed.parallel_state_wrapper", "ParallelState",
                         "attn_tp_rank, attn_tp_size", "the KV heads of this rank")
MODEL_CONFIG = _fields("sglang.srt.configs.model_config", "ModelConfig",
                       "hf_config, head_dim, num_hidden_layers, num_attention_heads, num_key_value_heads, context_len",
                       "model shape")
GET_NUM_KV_HEADS = _fn("sglang.srt.configs.model_config", "ModelConfig.get_num_kv_heads",
                       "self, tensor_parallel_size", "KV heads per rank")
MODEL_RUNNER = _fields("sglang.srt.model_executor.model_runner", "ModelRunner",
                       "req_to_token_pool, token_to_kv_pool, model_config, server_args, device",
                       "the backend factory reads these")
REQ_TO_TOKEN_POOL = _fields(_MEM, "ReqToTokenPool", "size, req_to_token, max_context_len",
                            "rows of req_to_token (row 0 pads CUDA graphs)")
RADIX_ATTENTION = _fields("sglang.srt.layers.radix_attention", "RadixAttention",
                          "layer_id, tp_q_head_num, tp_k_head_num, qk_head_dim, v_head_dim, scaling, logit_cap, "
                          "sliding_window_size",
                          "per-layer shape and options")
REQ = _fields("sglang.srt.managers.schedule_batch", "Req",
              "rid, req_pool_idx, extra_key, origin_input_ids, output_ids, kv_committed_len",
              "what the radix cache reads of a request")
RADIX_CACHE_FIELDS = _fields(_RADIX, "RadixCache", "disable, req_to_token_pool, token_to_kv_pool_allocator",
                             "the OSCAR radix cache reads these")
SERVER_ARGS = _fields(_SA, "ServerArgs",
                      "model_path, attention_backend, prefill_attention_backend, decode_attention_backend, "
                      "speculative_algorithm, enable_hierarchical_cache, disaggregation_mode, enable_mixed_chunk, "
                      "page_size, kv_cache_dtype, enable_dp_attention, tp_size, pp_size, dcp_size, radix_cache_backend, "
                      "max_running_requests, json_model_override_args, disable_overlap_schedule, enable_lmcache, "
                      "enable_flexkv, enable_two_batch_overlap, enable_pdmux, enable_streaming_session, load_format, "
                      "device, cuda_graph_backend_prefill, cuda_graph_config, disable_radix_cache, "
                      "chunked_prefill_size, max_prefill_tokens",
                      "the refusals and sizing read these")
HOOK_FORWARD = _fn("sglang.srt.model_executor.model_runner", "ModelRunner.forward",
                   "self, forward_batch, skip_attn_backend_init, pp_proxy_tensors, reinit_attn_backend, "
                   "split_forward_count",
                   "AROUND hook of the benchmark plugin (oscar bench --fill null): extends that skip the model")
NULL_FILL_OUTPUT = (
    _fields("sglang.srt.layers.logits_processor", "LogitsProcessorOutput", "next_token_logits, hidden_states",
            "what a skipped extend returns"),
    _fields("sglang.srt.model_executor.model_runner", "ModelRunnerOutput", "logits_output, can_run_graph",
            "what a skipped extend returns"),
)
ENVS = _fields("sglang.srt.environ", "Envs", "SGLANG_PLUGINS, SGLANG_ENABLE_POST_CAPTURE_KV_SIZING",
               "the plugin whitelist; post-capture KV sizing (refused)")

TARGETS: tuple[Target, ...] = (
    *HOOKS, ADD_BACKEND_CHOICES, REGISTER_BACKEND, REGISTER_RADIX, REGISTERED_RADIX, DEFAULT_RADIX_FACTORY,
    HOOK_REGISTER, HOOK_TYPE, ATTENTION_BACKEND, *BACKEND_METHODS, KV_CACHE, *KV_CACHE_METHODS, RADIX_CACHE,
    *RADIX_METHODS, RADIX_KEY, MATCH_PARAMS, CACHE_PARAMS, ALLOCATOR_GET_KVCACHE, EXTRA_CONTEXT_LEN, TREE_CONTEXT, FORWARD_BATCH, *FORWARD_MODE, KV_CONFIGURATOR, LAYER_INFO,
    PARALLEL_STATE, MODEL_CONFIG, GET_NUM_KV_HEADS, MODEL_RUNNER, REQ_TO_TOKEN_POOL, RADIX_ATTENTION, REQ,
    RADIX_CACHE_FIELDS, SERVER_ARGS, ENVS, HOOK_FORWARD, *NULL_FILL_OUTPUT,
)


# ---------------------------------------------------------------------------------------------------- source checks
def _ast_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    a = fn.args
    out = [p.arg for p in (*a.posonlyargs, *a.args)]
    if a.vararg is not None:
        out.append(f"*{a.vararg.arg}")
    elif a.kwonlyargs:
        out.append("*")
    out += [p.arg for p in a.kwonlyargs]
    if a.kwarg is not None:
        out.append(f"**{a.kwarg.arg}")
    return tuple(out)


def _find(body: Iterable[ast.stmt], name: str) -> ast.AST | None:
    found = None
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            found = node  # the last definition wins, as at import time
    return found


def _assigned_names(cls: ast.ClassDef) -> set[str]:
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                names.add(t.attr)
    return names


def _module_files(module: str) -> tuple[str, str]:
    base = module.replace(".", "/")
    return f"{base}.py", f"{base}/__init__.py"


class SourceTree:
    """SGLang's sources, from a folder holding ``sglang/`` or from the wheel file itself (read in place)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._zip = zipfile.ZipFile(self.root) if self.root.is_file() else None
        self._cache: dict[str, ast.Module | None] = {}

    def read(self, relpath: str) -> str | None:
        if self._zip is not None:
            try:
                return self._zip.read(relpath).decode()
            except KeyError:
                return None
        p = self.root / relpath
        return p.read_text() if p.is_file() else None

    def module(self, module: str) -> ast.Module | None:
        if module not in self._cache:
            text = None
            for rel in _module_files(module):
                text = self.read(rel)
                if text is not None:
                    break
            self._cache[module] = None if text is None else ast.parse(text)
        return self._cache[module]


def check_target(tree: SourceTree, t: Target) -> str | None:
    """The problem with one target in ``tree`` (one line), or None when SGLang still has it as registered."""
    mod = tree.module(t.module)
    if mod is None:
        return f"{t.path}: module {t.module} not found"
    node: ast.AST | None = None
    body = mod.body
    for part in t.qualname.split("."):
        node = _find(body, part)
        if node is None:
            return f"{t.path}: {part!r} not found"
        body = node.body if isinstance(node, ast.ClassDef) else []
    if t.kind == "function":
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return f"{t.path}: is not a function"
        got = _ast_params(node)
        if got != t.params:
            return f"{t.path}: parameters ({', '.join(got)}) != expected ({', '.join(t.params)})"
    elif t.kind in ("class", "fields"):
        if not isinstance(node, ast.ClassDef):
            return f"{t.path}: is not a class"
        if t.kind == "fields":
            missing = [f for f in t.fields if f not in _assigned_names(node)]
            if missing:
                return f"{t.path}: no attribute(s) {', '.join(missing)}"
    else:
        return f"{t.path}: unknown target kind {t.kind!r}"
    return None


def check_source(root: Path, targets: Iterable[Target] = TARGETS) -> list[str]:
    """Problems (one line each) of every target against the SGLang sources under ``root``; empty when all hold."""
    tree = SourceTree(root)
    return [p for p in (check_target(tree, t) for t in targets) if p is not None]


# ---------------------------------------------------------------------------------------------------- live checks
def _live_params(fn: Callable) -> tuple[str, ...]:
    out: list[str] = []
    star = False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            out.append(f"*{p.name}")
            star = True
        elif p.kind is p.KEYWORD_ONLY:
            if not star:
                out.append("*")
                star = True
            out.append(p.name)
        elif p.kind is p.VAR_KEYWORD:
            out.append(f"**{p.name}")
        else:
            out.append(p.name)
    return tuple(out)


def _resolve(path: str):
    mod, _, rest = path.partition(":")
    obj = importlib.import_module(mod)
    for part in rest.split("."):
        obj = inspect.getattr_static(obj, part) if isinstance(obj, type) else getattr(obj, part)
    return obj


def check_live(targets: Iterable[Target]) -> list[str]:
    """Like :func:`check_source` on the imported modules (inside SGLang's processes). ``fields`` targets are not
    checked live (instance attributes exist only on instances)."""
    problems = []
    for t in targets:
        if t.kind != "function":
            continue
        try:
            obj = _resolve(f"{t.module}:{t.qualname}")
        except (ImportError, AttributeError) as e:
            problems.append(f"{t.path}: {e}")
            continue
        fn = obj.__func__ if isinstance(obj, (classmethod, staticmethod)) else obj
        got = _live_params(inspect.unwrap(fn))  # a classmethod's function lists cls, like the source
        if got != t.params:
            problems.append(f"{t.path}: parameters ({', '.join(got)}) != expected ({', '.join(t.params)})")
    return problems
