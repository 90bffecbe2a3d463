"""The plugin inside real SGLang 0.5.17 code, on whatever device there is: ``load_plugins()`` with the entry point,
the hooks applied, SGLang's parser and ``check_server_args``, the radix cache built by SGLang's registry, and the
pool / backend classes over SGLang's own base classes, driven like SGLang drives them (extend, decode).

Skipped where SGLang is not importable (the CPU CI: SGLang 0.5.17 pins a CUDA torch); runs on the GPU machine with
SGLang's site on ``PYTHONPATH`` and the plugin installed (``benchmarks/sglang_h200.sh`` builds both), and on a CPU
machine with a CPU-importable SGLang site."""

from __future__ import annotations

import json
import os
from array import array
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang.srt.plugins", reason="SGLang is not installed here (it pins a CUDA torch)")
os.environ.setdefault("SGLANG_PLUGINS", "oscar")

from oscar_cli.serve.sglang import plugin  # noqa: E402
from oscar_cli.serve.sglang import targets as T  # noqa: E402
from oscar_cli.serve.sglang.launch import build_launch  # noqa: E402
from oscar_cli.serve.sglang.refusals import ServeRefusal  # noqa: E402
from oscar_cli.serve.sglang.settings import OscarSettings, write_settings  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
L, HQ, HKV, D = 2, 4, 2, 64  # head dim: the smallest the decode kernel runs at on CUDA (CUDA_MIN_HEAD_DIM)


@pytest.fixture(scope="module")
def loaded():
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    load_plugins()
    return HookRegistry


def test_entry_point_loads_and_hooks_apply(loaded):
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.mem_cache.registry import registered_radix_cache_backends
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    assert {t.path for t in T.HOOKS} <= loaded._patched
    assert "oscar" in ATTENTION_BACKEND_CHOICES and "oscar" in ATTENTION_BACKENDS
    assert "oscar" in registered_radix_cache_backends()
    assert plugin.TARGET_PROBLEMS == []


def test_sglang_parses_the_launch_argv_and_refuses_in_check_server_args(loaded, tmp_path):
    from sglang.srt.server_args import prepare_server_args

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": L,
        "num_attention_heads": HQ, "num_key_value_heads": HKV, "hidden_size": HQ * D, "intermediate_size": 128,
        "vocab_size": 100, "max_position_embeddings": 512}))
    argv, env = build_launch(str(model), tmp_path / "art", "127.0.0.1", 30000, ["--sampling-backend", "pytorch"])
    extra = [] if DEVICE == "cuda" else ["--device", "cpu"]
    sa = prepare_server_args(argv[3:] + extra + ["--enable-mixed-chunk"])
    assert (sa.attention_backend, sa.radix_cache_backend, sa.max_running_requests) == ("oscar", "oscar", 64)
    with pytest.raises(ServeRefusal) as e:
        sa.check_server_args()
    assert "--enable-mixed-chunk" in str(e.value)


def test_radix_cache_from_sglangs_registry_caps_matches(loaded):
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache

    from oscar_cli.serve.sglang.anchors import AnchorTable

    table = AnchorTable(201, 4, DEVICE)
    oscar = SimpleNamespace(table=table, region_pos={}, finish_anchors=False, finished=table.unpin)
    rtp = ReqToTokenPool(size=4, max_context_len=128, device=DEVICE, enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(200, dtype=torch.bfloat16, device=DEVICE, kvcache=SimpleNamespace(oscar=oscar),
                                   need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, page_size=1)
    ctx = TreeCacheBuildContext(server_args=SimpleNamespace(radix_cache_backend="oscar", enable_session_radix_cache=False,
                                                            enable_streaming_session=False),
                                params=params, is_hybrid_swa=False, is_hybrid_ssm=False, enable_hierarchical_cache=False,
                                disable_radix_cache=False, effective_chunked_prefill_size=None, tp_worker=None,
                                model_config=None, tp_size=1, tp_rank=0, tp_group=None)
    cache = create_tree_cache(ctx)
    assert type(cache).__name__ == "OscarRadixCache"
    slots = alloc.alloc(40)
    cache.insert(InsertParams(key=RadixKey(array("q", range(100, 140))), value=slots.clone()))
    table.bind(torch.tensor([0, 1]), torch.stack([slots[15], slots[31]]).long())
    q = array("q", [*range(100, 137), 7, 8])
    res = cache.match_prefix(MatchPrefixParams(key=RadixKey(q, limit=len(q) - 1), req=SimpleNamespace(rid="B")))
    assert torch.equal(res.device_indices, slots[:32]) and len(res.last_device_node.key) == 32 and table.pinned(1)
    assert len(cache.match_prefix(MatchPrefixParams(key=RadixKey(q))).device_indices) == 37  # SGLang's own re-match


@pytest.mark.parametrize("scale_dtype", ["fp16", "fp8", "fp8-allocated"])
def test_pool_and_backend_over_sglangs_base_classes(loaded, tmp_path, scale_dtype):
    """The pool hook builds the OSCAR pool, the backend plans and runs an extend and a decode step of two layers;
    with fp16 scales, with FP8 ones (the artifact's per-head multipliers reach the pool), and with an allocation
    (4-bit keys in layer 0, 4-bit values in layer 1, as ``oscar fit --bits-per-element`` writes)."""
    allocated = scale_dtype == "fp8-allocated"
    scale_dtype = "fp8" if allocated else scale_dtype
    widths = dict(bits_k=(4, 2), bits_v=(2, 4)) if allocated else {}
    from oscar_kernels.scheme import QuantScheme
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from oscar_cli.artifact import Manifest, write_artifact
    from oscar_cli.config import AttentionShape

    eye = torch.eye(D).expand(L, HKV, D, D).contiguous()
    t = {"layers": torch.arange(L), "r_k": eye, "r_v": eye.clone(), "clip_k": torch.ones(L, HKV),
         "clip_v": torch.ones(L, HKV), "eig_k": torch.zeros(L, HKV, D), "eig_v": torch.zeros(L, HKV, D)}
    fp8 = scale_dtype == "fp8"
    if fp8:
        t["mult_k"], t["mult_v"] = torch.full((L, HKV), 2.0 ** -5), torch.full((L, HKV), 2.0 ** -6)
    m = Manifest(model_slug="t", model_fingerprint="sha256:t", run_id=None, stats_digest="", data_digest="",
                 calibration_tokens=0, method="hadamard", per_head=True, layers=tuple(range(L)),
                 shape=AttentionShape(L, HQ, HKV, D), scheme=QuantScheme(group=D, sink=4, recent=8,
                                                                         scale_dtype=scale_dtype, **widths),
                 fit_clip=False,
                 clip_grid=(), metrics={})
    art = write_artifact(tmp_path / "arts", m, t, "")
    hf = {"model_type": "llama", "num_hidden_layers": L, "num_attention_heads": HQ, "num_key_value_heads": HKV,
          "hidden_size": HQ * D, "head_dim": D}
    sa = SimpleNamespace(attention_backend="oscar", max_running_requests=3, model_path=str(tmp_path / "hub-id"),
                         load_format="dummy", json_model_override_args=write_settings(OscarSettings(artifact=art)),
                         chunked_prefill_size=64, max_prefill_tokens=64, cuda_graph_config=None,
                         disable_overlap_schedule=True, speculative_algorithm=None, page_size=1,
                         max_speculative_num_draft_tokens=None)
    mc = SimpleNamespace(context_len=60, hf_config=SimpleNamespace(to_dict=lambda: hf))
    kvc = SimpleNamespace(server_args=sa, model_config=mc, is_draft_worker=False, device=DEVICE,
                          kv_cache_dtype=torch.bfloat16, ps=SimpleNamespace(attn_tp_size=1, attn_tp_rank=0),
                          layer_info=SimpleNamespace(start_layer=0, num_effective_layers=L))
    high_plane = D // 4 if allocated else 0  # one 4-bit kind per layer: a second plane of code bytes
    assert plugin.around_cell_size(None, None, kvc, L) == L * HKV * (2 * (D // 4 + (2 if fp8 else 4)) + high_plane)
    pool = plugin.around_build_pool(None, kvc, max_total_num_tokens=100, mha_pool_class=None)
    layers = [RadixAttention(HQ, D, D ** -0.5, HKV, layer_id=i) for i in range(L)]
    rtp = ReqToTokenPool(size=3, max_context_len=64, device=DEVICE, enable_memory_saver=False)
    runner = SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=rtp, model=torch.nn.ModuleList(layers),
                             server_args=sa, model_config=mc)
    backend = plugin.create_backend(runner)
    g = torch.Generator().manual_seed(0)
    rtp.req_to_token[1, :20] = torch.arange(1, 21, dtype=torch.int32)
    fb = SimpleNamespace(forward_mode=ForwardMode.EXTEND, req_pool_indices=torch.tensor([1], device=DEVICE),
                         extend_prefix_lens=torch.tensor([0], device=DEVICE),
                         extend_seq_lens=torch.tensor([20], device=DEVICE), extend_prefix_lens_cpu=[0],
                         extend_seq_lens_cpu=[20], out_cache_loc=torch.arange(1, 21, device=DEVICE), rids=["r"])
    backend.init_forward_metadata(fb)
    for lay in layers:
        q = torch.randn(20, HQ * D, generator=g).to(DEVICE, torch.bfloat16)
        k, v = (torch.randn(20, HKV, D, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
        out = backend.forward_extend(q, k, v, lay, fb)
        assert out.shape == (20, HQ * D) and torch.isfinite(out.float()).all()
    rtp.req_to_token[1, 20] = 21
    fb = SimpleNamespace(forward_mode=ForwardMode.DECODE, req_pool_indices=torch.tensor([1, 0], device=DEVICE),
                         seq_lens=torch.tensor([21, 1], device=DEVICE), out_cache_loc=torch.tensor([21], device=DEVICE))
    backend.init_forward_metadata_out_graph(fb)  # a CUDA-graph replay view: padded to 2 rows
    for lay in layers:
        q = torch.randn(2, HQ * D, generator=g).to(DEVICE, torch.bfloat16)
        k, v = (torch.randn(2, HKV, D, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
        assert torch.isfinite(backend.forward_decode(q, k, v, lay, fb).float()).all()
    assert pool.oscar.table.deepest(torch.arange(1, 21, device=DEVICE))[0] == 20  # the prompt-end anchor
    assert Path(pool.setup.settings.artifact) == art
    c = pool.oscar.pool.layer(1)
    assert c.fp8 == fp8 and (not fp8 or torch.equal(c.v.mult.cpu(), t["mult_v"][1]))
    assert (c.k.bits, c.v.bits) == ((2, 4) if allocated else (2, 2))
