"""The SGLang-facing functions without SGLang: what ``register()`` registers, that every hook passes through unless
``--attention-backend oscar`` is chosen, the launcher-side refusals, and the per-layer checks of the backend."""

from __future__ import annotations

import json
import sys
import types
from types import SimpleNamespace

import pytest

from oscar_cli.errors import OscarError
from oscar_cli.serve.sglang import plugin
from oscar_cli.serve.sglang import targets as T
from oscar_cli.serve.sglang.refusals import ServeRefusal
from oscar_cli.serve.sglang.settings import OscarSettings, read_settings, write_settings


@pytest.fixture
def fake_sglang(monkeypatch):
    """Just enough of SGLang's registration modules to run ``install()``."""
    calls = SimpleNamespace(choices=[], backends={}, radix={}, hooks=[])
    mods = {}
    for name in {t.module for t in T.TARGETS} | {"sglang", "sglang.srt"}:
        mods[name] = types.ModuleType(name)
    sa = mods["sglang.srt.server_args"]
    sa.ATTENTION_BACKEND_CHOICES = calls.choices
    sa.add_attention_backend_choices = lambda choices: calls.choices.extend(choices)
    reg = mods["sglang.srt.layers.attention.attention_registry"]
    reg.register_attention_backend = lambda name: (lambda fn: calls.backends.__setitem__(name, fn) or fn)
    rr = mods["sglang.srt.mem_cache.registry"]
    rr.register_radix_cache_backend = lambda name, factory: calls.radix.__setitem__(name, factory)
    rr.registered_radix_cache_backends = lambda: list(calls.radix)
    hr = mods["sglang.srt.plugins.hook_registry"]

    class HookType:
        AFTER, AROUND = "after", "around"

    class HookRegistry:
        @classmethod
        def register(cls, target, hook, hook_type="after", *, source=None):
            calls.hooks.append((target, hook, hook_type))

    hr.HookRegistry, hr.HookType = HookRegistry, HookType
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return calls


def test_install_registers_the_name_the_factories_and_four_hooks(fake_sglang):
    plugin.install()
    plugin.install()  # load_plugins guards against a second call; install() is idempotent anyway
    assert fake_sglang.choices == ["oscar"]
    assert fake_sglang.backends == {"oscar": plugin.create_backend}
    assert fake_sglang.radix == {"oscar": plugin.create_radix_cache}
    hooks = {(t, kind) for t, _, kind in fake_sglang.hooks}
    assert hooks == {(T.HOOK_CHECK_ARGS.path, "after"), (T.HOOK_AVAILABLE_BYTES.path, "around"),
                     (T.HOOK_CELL_SIZE.path, "around"), (T.HOOK_BUILD_POOL.path, "around")}
    # the fakes lack the hooked methods: register() reports them instead of failing (SGLang would only log)
    assert any("_build_mha_kv_pool" in p for p in plugin.TARGET_PROBLEMS)
    plugin.TARGET_PROBLEMS.clear()


def other_backend(**kw):
    return SimpleNamespace(attention_backend="triton", **kw)


def test_hooks_pass_through_for_other_backends():
    """With SGLANG_PLUGINS unset every plugin loads: nothing changes for a server that does not choose oscar."""
    seen = []

    def original(*args, **kwargs):
        seen.append((args, kwargs))
        return 123

    kvc = SimpleNamespace(server_args=other_backend(), is_draft_worker=False)
    assert plugin.around_available_bytes(original, kvc, 7) == 123
    assert plugin.around_cell_size(original, "cfg", kvc, 36) == 123
    assert plugin.around_build_pool(original, kvc, max_total_num_tokens=5, mha_pool_class=int, quant_method=None) == 123
    assert seen == [((kvc, 7), {}), (("cfg", kvc, 36), {}),
                    ((kvc,), {"max_total_num_tokens": 5, "mha_pool_class": int, "quant_method": None})]
    assert plugin.after_check_server_args(None, other_backend()) is None
    draft = SimpleNamespace(server_args=SimpleNamespace(attention_backend="oscar"), is_draft_worker=True)
    assert plugin.around_cell_size(original, "cfg", draft, 2) == 123


def test_memory_hooks_refuse_a_budget_too_small_and_a_layer_count_mismatch(monkeypatch):
    """The fixed bytes (exact regions, anchors, workspaces) larger than SGLang's KV budget, and SGLang sizing another
    number of layers than the pool holds, are refused in one line naming the fix; otherwise the budget loses the
    fixed bytes and the cell is the pool's."""
    budget = SimpleNamespace(fixed=3 * 2**30, cell=4321)
    monkeypatch.setattr(plugin, "rank_setup_of", lambda kvc: SimpleNamespace(budget=budget, num_layers=36))
    kvc = SimpleNamespace(server_args=SimpleNamespace(attention_backend="oscar"), is_draft_worker=False)
    with pytest.raises(ServeRefusal) as e:
        plugin.around_available_bytes(lambda kvc, pre: 2 * 2**30, kvc, 0)
    assert "exceeds the KV budget (2.00 GiB)" in str(e.value) and "--max-running-requests" in str(e.value)
    assert "\n" not in str(e.value)
    assert plugin.around_available_bytes(lambda kvc, pre: 5 * 2**30, kvc, 0) == 2 * 2**30
    with pytest.raises(ServeRefusal, match="SGLang sizes 35 KV layers, the OSCAR pool 36"):
        plugin.around_cell_size(lambda *a: 0, "cfg", kvc, 35)
    assert plugin.around_cell_size(lambda *a: 0, "cfg", kvc, 36) == 4321


def oscar_args(tmp_path, **kw):
    base = dict(attention_backend="oscar", radix_cache_backend="oscar", disable_radix_cache=False,
                max_running_requests=8, model_path=str(tmp_path / "no-model"), tp_size=1, load_format="auto",
                json_model_override_args=write_settings(OscarSettings(artifact=tmp_path / "art")))
    base.update(kw)
    return SimpleNamespace(**base)


def test_launcher_refuses_with_one_line(tmp_path):
    with pytest.raises(ServeRefusal) as e:
        plugin.after_check_server_args(None, oscar_args(tmp_path, speculative_algorithm="EAGLE"))
    assert str(e.value).startswith("oscar: --speculative-algorithm EAGLE") and "\n" not in str(e.value)
    with pytest.raises(ServeRefusal) as e:
        plugin.after_check_server_args(None, oscar_args(tmp_path, json_model_override_args="{}"))
    assert "no \"oscar\" entry" in str(e.value)
    with pytest.raises(ServeRefusal) as e:
        plugin.after_check_server_args(None, oscar_args(tmp_path, radix_cache_backend=None))
    assert "--radix-cache-backend oscar" in str(e.value)
    # arguments fine, the model is a hub id (no local folder): the model checks wait for the scheduler
    assert plugin.after_check_server_args(None, oscar_args(tmp_path)) is None


def test_launcher_checks_the_artifact_against_a_local_model(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2,
                                                   "num_attention_heads": 4, "num_key_value_heads": 2,
                                                   "hidden_size": 64}))
    with pytest.raises(OscarError) as e:  # the artifact folder does not exist
        plugin.after_check_server_args(None, oscar_args(tmp_path, model_path=str(model)))
    assert "is not an artifact" in str(e.value)


def test_max_extend_tokens_covers_chunks_budget_and_graph_buckets():
    sa = SimpleNamespace(chunked_prefill_size=4096, max_prefill_tokens=16384,
                         cuda_graph_config=SimpleNamespace(prefill=SimpleNamespace(bs=[512, 2048, 32768])))
    assert plugin.max_extend_tokens(sa, 40960) == 32768
    assert plugin.max_extend_tokens(SimpleNamespace(chunked_prefill_size=-1, max_prefill_tokens=8192), 40960) == 40960


def layer(i, **kw):
    base = dict(layer_id=i, scaling=0.25, tp_q_head_num=4, tp_k_head_num=2, qk_head_dim=16, v_head_dim=16,
                logit_cap=0.0, sliding_window_size=-1)
    base.update(kw)
    return SimpleNamespace(**base)


SETUP = SimpleNamespace(q_heads=4, kv_heads=2, head_dim=16)


def test_layer_checks():
    assert plugin.check_layers([layer(0), layer(1)], SETUP) == 0.25
    for bad, words in ((layer(1, logit_cap=30.0), "logit cap"), (layer(1, sliding_window_size=4096), "sliding"),
                       (layer(1, tp_k_head_num=1), "KV heads"), (layer(1, scaling=0.5), "softmax scales")):
        with pytest.raises(ServeRefusal) as e:
            plugin.check_layers([layer(0), bad], SETUP)
        assert words in str(e.value)


def test_layer_facts_finds_attention_modules():
    import torch

    class Attn(torch.nn.Module):
        def __init__(self, i):
            super().__init__()
            for k, v in vars(layer(i)).items():
                setattr(self, k, v)

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Attn(0), torch.nn.Sequential(Attn(1)))
    assert [m.layer_id for m in plugin.layer_facts(model)] == [0, 1]


@pytest.fixture
def fake_base_backend(monkeypatch):
    """SGLang's ``AttentionBackend`` base class, empty, so that ``backend_class()`` builds without SGLang."""
    base = types.ModuleType("sglang.srt.layers.attention.base_attn_backend")

    class AttentionBackend:
        def __init__(self):
            pass

    base.AttentionBackend = AttentionBackend
    monkeypatch.setitem(sys.modules, "sglang.srt.layers.attention.base_attn_backend", base)
    plugin.backend_class.cache_clear()
    yield
    plugin.backend_class.cache_clear()


def test_backend_refuses_without_its_pool(fake_base_backend):
    """If SGLang's hook registry failed to apply the pool hook, the backend says so instead of running on BF16."""
    with pytest.raises(ServeRefusal) as e:
        plugin.create_backend(SimpleNamespace(token_to_kv_pool=object()))
    assert "Failed to apply hooks" in str(e.value)


def test_backend_runs_its_decode_plan_with_the_settings_decode_options(fake_base_backend, tmp_path):
    """The decode options the launcher wrote into ``--json-model-override-args`` are, read back by the rank's setup,
    the backend's decode plan ``options``, unchanged."""
    import torch
    from oscar_kernels.scheme import DecodeOptions, QuantScheme

    from oscar_cli.serve.sglang.core import OscarKV

    options = DecodeOptions(int8_scores=True, int8_values=True, lean_tiles=True, split_tokens=64)
    settings = read_settings(write_settings(OscarSettings(artifact=tmp_path / "art", decode=options)))
    n, h, d = 2, SETUP.kv_heads, SETUP.head_dim
    rot = torch.eye(d).expand(n, h, d, d).contiguous()
    kv = OscarKV(QuantScheme(sink=4, recent=8), n, h, d, 64, 4, rot, rot, torch.ones(n, h), torch.ones(n, h),
                 anchors=2, anchor_interval=0, device="cpu")
    setup = SimpleNamespace(settings=settings, q_heads=SETUP.q_heads, kv_heads=h, head_dim=d, start_layer=0)
    attn = [torch.nn.Module() for _ in range(n)]
    for i, m in enumerate(attn):
        vars(m).update(vars(layer(i)))
    runner = SimpleNamespace(token_to_kv_pool=SimpleNamespace(oscar=kv, setup=setup),
                             req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(4, 32, dtype=torch.int32)),
                             model=torch.nn.Sequential(*attn), model_config=SimpleNamespace(context_len=32),
                             server_args=SimpleNamespace(chunked_prefill_size=16, max_prefill_tokens=16))
    backend = plugin.create_backend(runner)
    assert backend.core.decode.options == options and backend.core.decode.options != DecodeOptions()
    # what the backend refuses at run time, each in one line: a forward mode it does not implement, attention
    # asked not to store the new K/V (or with extra arguments), CUDA graphs larger than the request table
    mode = SimpleNamespace(name="TARGET_VERIFY", is_idle=lambda: False, is_decode_or_idle=lambda: False)
    with pytest.raises(ServeRefusal, match="forward mode TARGET_VERIFY is not supported"):
        backend.init_forward_metadata(SimpleNamespace(forward_mode=mode))
    q = torch.zeros(1, SETUP.q_heads * d)
    kv1 = torch.zeros(1, h * d)
    for kw in (dict(save_kv_cache=False), dict(sinks=torch.zeros(1))):
        with pytest.raises(ServeRefusal, match="OSCAR writes every new token's K/V itself"):
            backend.forward_decode(q, kv1, kv1, attn[0], None, **kw)
    with pytest.raises(ServeRefusal, match="exceed the request table"):
        backend.init_cuda_graph_state(64, 64)
