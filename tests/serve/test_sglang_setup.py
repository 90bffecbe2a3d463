"""Tensor-parallel slicing, the memory budget SGLang is given, the settings channel and the start-time refusals."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from oscar_kernels.scheme import DecodeOptions, QuantScheme

from oscar_cli.config import AttentionShape
from oscar_cli.serve.sglang.core import OscarAttention, OscarKV
from oscar_cli.serve.sglang.refusals import (
    ARG_RULES,
    ModelFacts,
    ServeRefusal,
    model_refusals,
    server_args_refusals,
    server_args_view,
)
from oscar_cli.serve.sglang.settings import (
    OscarSettings,
    SettingsError,
    read_settings,
    write_settings,
)
from oscar_cli.serve.sglang.setup import load_checked_artifact, rank_setup
from oscar_cli.serve.sglang.sizing import budget
from oscar_cli.serve.sglang.tp import layer_stack, rank_heads, slice_for_rank


def artifact_tensors(n=3, h=4, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"layers": torch.arange(n), "r_k": torch.randn(n, h, d, d, generator=g),
            "r_v": torch.randn(n, h, d, d, generator=g), "clip_k": torch.rand(n, h, generator=g),
            "clip_v": torch.rand(n, h, generator=g), "eig_k": torch.rand(n, h, d, generator=g),
            "eig_v": torch.rand(n, h, d, generator=g)}


# ------------------------------------------------------------------------------------------------------ TP
def test_slice_for_rank_keeps_each_ranks_heads():
    t = artifact_tensors(h=4)
    parts = [slice_for_rank(t, kv_heads=4, tp_size=2, rank=r) for r in range(2)]
    for key in ("r_k", "r_v", "clip_k", "clip_v"):
        assert parts[0][key].shape[1] == 2
        torch.testing.assert_close(torch.cat([p[key] for p in parts], dim=1), t[key], rtol=0, atol=0)
    assert parts[1]["eig_k"] is t["eig_k"]  # tensors without a per-rank use pass through
    same = slice_for_rank(t, kv_heads=4, tp_size=1, rank=0)
    assert all(torch.equal(same[k], t[k]) for k in t)
    t["mult_k"] = torch.exp2(-torch.arange(12.0)).view(3, 4)  # an FP8 artifact's multipliers: per head too
    parts = [slice_for_rank(t, kv_heads=4, tp_size=2, rank=r) for r in range(2)]
    assert torch.equal(torch.cat([p["mult_k"] for p in parts], dim=1), t["mult_k"])
    stacked = layer_stack(parts[1], [0, 1, 2], num_layers=2, start=1)
    assert torch.equal(stacked["mult_k"], t["mult_k"][1:, 2:]) and "mult_v" not in stacked
    t["center_k"] = torch.randn(3, 4, 5)  # a centered artifact's key centers [n, Hkv, d]: each rank its heads'
    parts = [slice_for_rank(t, kv_heads=4, tp_size=2, rank=r) for r in range(2)]
    assert torch.equal(torch.cat([p["center_k"] for p in parts], dim=1), t["center_k"])
    assert torch.equal(layer_stack(parts[0], [0, 1, 2], num_layers=3)["center_k"], t["center_k"][:, :2])


def test_shared_rotation_is_kept_on_every_rank():
    t = artifact_tensors(h=1)
    for r in range(4):
        s = slice_for_rank(t, kv_heads=8, tp_size=4, rank=r)
        assert torch.equal(s["r_k"], t["r_k"]) and s["clip_v"].shape == (3, 1)


@pytest.mark.parametrize("kv, tp, words", [(4, 3, "does not divide"), (4, 8, "replicate"), (2, 4, "replicate")])
def test_tp_that_cannot_split_by_head_is_refused(kv, tp, words):
    with pytest.raises(ServeRefusal) as e:
        rank_heads(kv, tp, 0)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_rank_heads_and_layer_order():
    assert [rank_heads(8, 4, r) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    t = artifact_tensors(n=3)
    t_perm = {k: v[[2, 0, 1]] for k, v in t.items()}  # artifact listing layers 2, 0, 1
    s = layer_stack(t_perm, [2, 0, 1], num_layers=3)
    assert torch.equal(s["r_k"], t["r_k"]) and torch.equal(s["clip_v"], t["clip_v"])


def fake_artifact(per_head=True, kv=4, heads=8, d=16, layers=3, scheme=None, fingerprint="sha256:abc"):
    t = artifact_tensors(n=layers, h=kv if per_head else 1, d=d)
    eye = torch.eye(d).expand_as(t["r_k"]).contiguous()
    t["r_k"], t["r_v"] = eye, eye.clone()
    t["clip_k"], t["clip_v"] = t["clip_k"] * 0.5 + 0.5, t["clip_v"] * 0.5 + 0.5
    m = SimpleNamespace(shape=AttentionShape(layers, heads, kv, d), layers=tuple(range(layers)),
                        model_fingerprint=fingerprint, scheme=scheme or QuantScheme(group=d, sink=4, recent=8))
    return SimpleNamespace(manifest=m, tensors=t, layers=list(range(layers)), scheme=m.scheme)


SERVED_D = 64
"""Head dim of the models the refusal tests serve: the decode kernel refuses smaller ones on CUDA."""


def facts(kv=4, heads=8, d=16, layers=3, **kw):
    return ModelFacts(model_type="llama", num_layers=layers, num_heads=heads, kv_heads=kv, head_dim=d, **kw)


def test_rank_setup_per_rank_cell_size_and_kernel_arguments():
    art = fake_artifact()
    setups = [rank_setup(OscarSettings(artifact=Path("a"), anchors=4), art, facts(), tp_size=2, tp_rank=r,
                         request_slots=5, max_tokens=64, max_seq_len=128) for r in range(2)]
    whole = rank_setup(OscarSettings(artifact=Path("a"), anchors=4), art, facts(), tp_size=1, tp_rank=0,
                       request_slots=5, max_tokens=64, max_seq_len=128)
    for r, s in enumerate(setups):
        assert (s.kv_heads, s.q_heads, s.rot_k.shape, s.clip_k.shape) == (2, 4, (3, 2, 16, 16), (3, 2))
        torch.testing.assert_close(s.clip_v, art.tensors["clip_v"][:, 2 * r:2 * r + 2])
        assert 2 * s.budget.cell == whole.budget.cell and 2 * s.budget.region == whole.budget.region


@pytest.mark.parametrize("variant", ["fp16", "fp8", "mixed-widths"])
def test_budget_counts_what_the_pool_and_plans_allocate(variant):
    """The bytes SGLang is told (cell size x slots + fixed) are the bytes the rank's pool and plans hold: with fp16
    scales, FP8 ones (and their multipliers), and an allocation (4-bit keys in layer 1, 4-bit values in layer 2)."""
    extra = {"fp16": {}, "fp8": dict(scale_dtype="fp8"), "mixed-widths": dict(bits_k=(2, 4, 2), bits_v=(2, 2, 4))}
    scheme, layers, kv, d, q_heads = QuantScheme(group=16, sink=4, recent=8, **extra[variant]), 3, 2, 16, 4
    slots, requests, anchors, max_tokens, max_seq = 100, 5, 3, 64, 128
    b = budget(scheme, layers, kv, d, q_heads, requests, anchors, max_tokens, max_seq)
    eye = torch.eye(d).expand(layers, 1, d, d)
    mult = torch.ones(layers, kv) if variant == "fp8" else None
    st = OscarKV(scheme, layers, kv, d, slots, requests, eye, eye, torch.ones(layers, 1), torch.ones(layers, 1),
                 anchors, 0, "cpu", mult_k=mult, mult_v=mult)
    per_layer = {"fp16": 3 * (2 * (d // 4 + 4)), "fp8": 3 * (2 * (d // 4 + 2)),
                 "mixed-widths": 3 * 2 * (d // 4 + 4) + 2 * d // 4}  # per head: a 4-bit kind doubles its codes
    assert b.cell == kv * per_layer[variant]
    core = OscarAttention(st, torch.zeros(requests, max_seq, dtype=torch.int32), requests, max_tokens, q_heads)
    assert b.cell == st.pool.cell_bytes
    assert (requests + anchors) * b.region == st.pool.exact_bytes
    assert b.workspace == core.workspace_bytes()
    held = st.pool.nbytes - st.pool.exact_bytes - sum(
        t.numel() * t.element_size() for i in range(layers)
        for t in (st.pool.layer(i).rot_k, st.pool.layer(i).rot_v, st.pool.layer(i).clip_k, st.pool.layer(i).clip_v)
        + ((st.pool.layer(i).k.mult, st.pool.layer(i).v.mult) if variant == "fp8" else ()))
    assert held == slots * b.cell


def test_qwen3_8b_shapes_get_at_least_6_5x_the_tokens():
    b = budget(QuantScheme(group=128, sink=64, recent=256), 36, 8, 128, 32, 65, 64, 8192, 4096)
    assert b.cell == 36 * 2 * 8 * 36 and b.bf16_cell == 36 * 2 * 8 * 256
    assert b.bf16_cell / b.cell >= 6.5
    assert b.region == 36 * 2 * 320 * 8 * 128 * 2


# ------------------------------------------------------------------------------------------------------ channel
def test_settings_round_trip_through_the_override_json():
    s = OscarSettings(artifact=Path("/a/v1"), anchors=16, anchor_interval=512)
    text = write_settings(s, json.dumps({"rope_theta": 1e6}))
    assert json.loads(text)["rope_theta"] == 1e6
    assert read_settings(text) == s
    assert read_settings('{"rope_theta": 1}') is None and read_settings(None) is None
    assert json.loads(text)["oscar"]["decode"] == {} and read_settings(text).decode == DecodeOptions()


def test_decode_options_travel_as_one_json_object():
    """``OscarSettings.decode`` is written as the options that differ from the defaults and read back equal; the
    defaults when the key is absent (settings written before it existed)."""
    options = DecodeOptions(int8_scores=True, int8_values=True, lean_tiles=True, num_stages=3, max_registers=0)
    s = OscarSettings(artifact=Path("/a/v1"), decode=options)
    text = write_settings(s)
    assert json.loads(text)["oscar"]["decode"] == {"int8_scores": True, "int8_values": True, "lean_tiles": True,
                                                   "num_stages": 3, "max_registers": 0}
    assert read_settings(text) == s and read_settings(text).decode == options
    assert read_settings('{"oscar": {"artifact": "/a/v1"}}').decode == DecodeOptions()
    with pytest.raises(SettingsError, match="decode must be DecodeOptions"):  # built at the edge, not a dict
        OscarSettings(artifact=Path("/a/v1"), decode={"int8_scores": True})


BAD_SETTINGS = [
    ('{"oscar": {"artifact": "a", "anchor": 3}}', "unknown key(s) anchor"),
    ('{"oscar": {"anchors": 3}}', "at least"),
    ('{"oscar": {"artifact": "a", "anchors": -1}}', "non-negative"),
    ('{"oscar": {"artifact": "a", "int8_scores": true}}', "unknown key(s) int8_scores"),  # the options' old keys
    ('{"oscar": {"artifact": "a", "decode_tuning": {}}}', "unknown key(s) decode_tuning"),
    ('{"oscar": {"artifact": "a", "decode": [1]}}', '"decode" of the "oscar" entry must be an object'),
    ('{"oscar": {"artifact": "a", "decode": {"lean": true}}}', 'unknown key(s) lean in "decode" of the "oscar" entry'),
    ('{"oscar": {"artifact": "a", "decode": {"int8_scores": 1}}}', "int8_scores must be true or false"),
    ('{"oscar": {"artifact": "a", "decode": {"lean_tiles": "yes"}}}', "lean_tiles must be true or false"),
    ('{"oscar": {"artifact": "a", "decode": {"num_stages": true}}}', "num_stages must be a positive integer"),
    ('{"oscar": {"artifact": "a", "decode": {"max_registers": -1}}}', "max_registers must be a non-negative"),
    ('{"oscar": {"artifact": "a", "decode": {"split_tokens": 1.5}}}', "split_tokens must be a positive"),
    ("{oscar", "not valid JSON"),
    ("[1]", "JSON object"),
]


@pytest.mark.parametrize("text, words", BAD_SETTINGS)
def test_bad_settings_are_one_line_errors(text, words):
    with pytest.raises(SettingsError) as e:
        read_settings(text)
    assert words in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------------------ refusals
REFUSED = {
    "speculative_algorithm": "EAGLE", "enable_hierarchical_cache": True, "enable_lmcache": True,
    "enable_flexkv": True, "disaggregation_mode": "decode", "enable_mixed_chunk": True, "page_size": 64,
    "kv_cache_dtype": "fp8_e4m3", "enable_dp_attention": True, "pp_size": 2, "dcp_size": 2,
    "enable_two_batch_overlap": True, "enable_pdmux": True, "enable_streaming_session": True,
    "cuda_graph_backend_prefill": "full", "prefill_attention_backend": "triton",
    "decode_attention_backend": "flashinfer", "max_running_requests": None, "device": "cpu",
}
ACCEPTED = {
    "speculative_algorithm": None, "enable_hierarchical_cache": False, "enable_lmcache": False,
    "enable_flexkv": False, "disaggregation_mode": None, "enable_mixed_chunk": False, "page_size": 1,
    "kv_cache_dtype": "auto", "enable_dp_attention": False, "pp_size": 1, "dcp_size": 1,
    "enable_two_batch_overlap": False, "enable_pdmux": False, "enable_streaming_session": False,
    "cuda_graph_backend_prefill": "breakable", "prefill_attention_backend": None, "decode_attention_backend": "oscar",
    "max_running_requests": 32, "device": "cuda", "radix_cache_backend": "oscar", "disable_radix_cache": False,
}


def test_every_rule_has_a_case():
    assert {f for f, _, _ in ARG_RULES} == set(REFUSED)


def test_accepted_server_args_pass():
    assert server_args_refusals(ACCEPTED, environ={}) == []


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_each_refused_setting_gives_one_line(field):
    got = server_args_refusals({**ACCEPTED, field: REFUSED[field]}, environ={})
    assert len(got) == 1 and got[0].startswith("--") and "\n" not in got[0], got


def test_radix_cache_must_be_oscars_unless_disabled():
    got = server_args_refusals({**ACCEPTED, "radix_cache_backend": None}, environ={})
    assert len(got) == 1 and "--radix-cache-backend oscar" in got[0]
    assert server_args_refusals({**ACCEPTED, "radix_cache_backend": None, "disable_radix_cache": True},
                                environ={}) == []


def test_post_capture_sizing_env_is_refused():
    got = server_args_refusals(ACCEPTED, environ={"SGLANG_ENABLE_POST_CAPTURE_KV_SIZING": "1"})
    assert len(got) == 1 and "unset" in got[0]


def test_view_of_live_server_args_reads_the_resolved_prefill_graph_backend():
    sa = SimpleNamespace(**{**ACCEPTED, "cuda_graph_backend_prefill": None, "disaggregation_mode": "null",
                            "cuda_graph_config": SimpleNamespace(prefill=SimpleNamespace(backend="full"))})
    view = server_args_view(sa)
    assert view["cuda_graph_backend_prefill"] == "full" and view["disaggregation_mode"] is None
    assert len(server_args_refusals(view, environ={})) == 1


def model_config(**kw):
    c = {"model_type": "llama", "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4,
         "hidden_size": 512, "head_dim": SERVED_D}
    c.update(kw)
    return c


@pytest.mark.parametrize("cfg, words", [
    (model_config(kv_lora_rank=512), "MLA"),
    (model_config(sliding_window=4096), "sliding-window"),
    (model_config(layer_types=["full_attention", "linear_attention", "full_attention"]), "hybrid"),
    (model_config(num_key_value_heads=2), "fitted for (layers, heads, KV heads, head dim)"),
    (model_config(num_hidden_layers=4), "fitted for"),
])
def test_model_refusals(cfg, words):
    problems, _ = model_refusals(fake_artifact(d=SERVED_D).manifest, ModelFacts.from_config(cfg))
    assert any(words in p for p in problems), problems


def test_head_dims_the_cuda_decode_kernel_refuses_are_refused_at_start():
    problems, _ = model_refusals(fake_artifact(d=32).manifest, ModelFacts.from_config(model_config(head_dim=32)))
    assert len(problems) == 1 and "decode kernel needs head dim >= 64, got 32" in problems[0], problems
    assert problems[0].endswith("serve it with `oscar serve --engine transformers`")


def test_model_facts_accept_plain_and_disabled_sliding_window_models():
    f = ModelFacts.from_config(model_config(sliding_window=4096, use_sliding_window=False))
    assert not f.sliding_window and not f.hybrid and not f.mla
    assert model_refusals(fake_artifact(d=SERVED_D).manifest, f)[0] == []


def test_fingerprint_checked_when_the_folder_has_one(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(model_config()))
    (tmp_path / "oscar_model.json").write_text(json.dumps({"fingerprint": "sha256:other"}))
    problems, _ = model_refusals(fake_artifact(d=SERVED_D).manifest, ModelFacts.from_folder(tmp_path))
    assert len(problems) == 1 and "sha256:other" in problems[0]
    (tmp_path / "oscar_model.json").write_text(json.dumps({"fingerprint": "sha256:abc"}))
    assert model_refusals(fake_artifact(d=SERVED_D).manifest, ModelFacts.from_folder(tmp_path)) == ([], [])


def test_without_a_fingerprint_the_head_layout_is_checked_and_said():
    problems, notes = model_refusals(fake_artifact(d=SERVED_D).manifest, facts(d=SERVED_D), load_format="dummy")
    assert problems == [] and "dummy" in notes[0] and "head layout" in notes[0]


def test_unquantized_layers_unsupported_scheme_and_tp_are_refused():
    art = fake_artifact()
    art.manifest.layers = (0, 2)
    problems, _ = model_refusals(art.manifest, facts())
    assert any("layer(s) 1 unquantized" in p for p in problems)
    art = fake_artifact(scheme=QuantScheme(bits=4, group=16))
    assert any("cannot run in the kernels" in p for p in model_refusals(art.manifest, facts())[0])
    n = facts().num_layers
    problems = model_refusals(fake_artifact(scheme=QuantScheme(group=16, levels="fitted")).manifest, facts())[0]
    assert any("cannot run in the kernels" in p and "without --levels" in p for p in problems), problems
    for scheme in (QuantScheme(scale_dtype="fp8"), QuantScheme(bits_k=(4,) + (2,) * (n - 1), bits_v=(2,) * n),
                   QuantScheme(scale_dtype="fp8", center_keys=True)):
        served = model_refusals(fake_artifact(d=SERVED_D, scheme=scheme).manifest, facts(d=SERVED_D))[0]
        assert not any("cannot run in the kernels" in p for p in served), served  # FP8, an allocation, centering
    assert any("--tp-size 3" in p for p in model_refusals(fake_artifact().manifest, facts(), tp_size=3)[0])


def test_a_real_artifact_against_a_model_folder(tmp_path):
    """``oscar_cli.artifact`` writes it, the plugin loads it (content hash checked) and refuses another model."""
    from oscar_cli.artifact import Manifest, write_artifact

    d, kv, heads, layers = SERVED_D, 2, 4, 2
    t = artifact_tensors(n=layers, h=kv, d=d)
    t["clip_k"], t["clip_v"] = t["clip_k"] * 0.5 + 0.5, t["clip_v"] * 0.5 + 0.5
    m = Manifest(model_slug="tiny", model_fingerprint="sha256:tiny", run_id=1, stats_digest="s", data_digest="d",
                 calibration_tokens=1, method="oscar", per_head=True, layers=tuple(range(layers)),
                 shape=AttentionShape(layers, heads, kv, d), scheme=QuantScheme(group=d, sink=4, recent=8),
                 fit_clip=True, clip_grid=(1.0,), metrics={})
    path = write_artifact(tmp_path / "arts", m, t, "")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(model_config(num_hidden_layers=layers, num_attention_heads=heads,
                                                               num_key_value_heads=kv, hidden_size=64, head_dim=d)))
    (model / "oscar_model.json").write_text(json.dumps({"fingerprint": "sha256:tiny"}))
    art, notes = load_checked_artifact(OscarSettings(artifact=path), ModelFacts.from_folder(model), tp_size=2)
    assert art.layers == [0, 1] and notes == []
    (model / "oscar_model.json").write_text(json.dumps({"fingerprint": "sha256:else"}))
    with pytest.raises(ServeRefusal) as e:
        load_checked_artifact(OscarSettings(artifact=path), ModelFacts.from_folder(model))
    assert str(e.value).startswith("oscar: the artifact was fitted for model fingerprint sha256:tiny")


def test_int8_decode_options_are_refused_for_an_allocation_with_4_bit_layers(tmp_path):
    """The int8 decode variants live in the Gluon kernel, which reads 2-bit codes: an artifact whose allocation has
    4-bit layers is refused with them at start (one line), and served with the default options."""
    from oscar_cli.artifact import Manifest, write_artifact

    d, kv, heads, layers = SERVED_D, 2, 4, 2
    t = artifact_tensors(n=layers, h=kv, d=d)
    t["clip_k"], t["clip_v"] = t["clip_k"] * 0.5 + 0.5, t["clip_v"] * 0.5 + 0.5
    scheme = QuantScheme(group=d, sink=4, recent=8, bits_k=(4, 2), bits_v=(2, 2))
    m = Manifest(model_slug="tiny", model_fingerprint="sha256:tiny", run_id=1, stats_digest="s", data_digest="d",
                 calibration_tokens=1, method="oscar", per_head=True, layers=tuple(range(layers)),
                 shape=AttentionShape(layers, heads, kv, d), scheme=scheme, fit_clip=True, clip_grid=(1.0,),
                 metrics={})
    path = write_artifact(tmp_path / "arts", m, t, "")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(model_config(num_hidden_layers=layers, num_attention_heads=heads,
                                                               num_key_value_heads=kv, hidden_size=64, head_dim=d)))
    facts = ModelFacts.from_folder(model)
    art, _ = load_checked_artifact(OscarSettings(artifact=path), facts)
    assert art.manifest.scheme.mixed
    with pytest.raises(ServeRefusal) as e:
        load_checked_artifact(OscarSettings(artifact=path, decode=DecodeOptions(int8_scores=True)), facts)
    assert "need 2-bit codes in every layer" in str(e.value) and "\n" not in str(e.value)
