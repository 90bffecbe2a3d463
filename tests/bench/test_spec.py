"""What ``oscar bench`` runs (:mod:`oscar_cli.bench.spec`): the run's configuration and its refusals, the engine
configurations and ``--decode-tuning`` over them, the Qwen3-8B-shaped model and artifact through the SGLang plugin's
own checks, and each configuration's server arguments."""

from __future__ import annotations

import json

import pytest
import torch
from oscar_kernels.scheme import DecodeOptions

from oscar_cli.bench.spec import (
    CONFIGS,
    NULL_FILL_FLAG,
    QWEN3_8B_SHAPED,
    BenchConfig,
    BenchError,
    check_with_plugin,
    model_fingerprint,
    parse_names,
    prepare_model,
    server_argv,
    tuned,
    tuning_label,
)
from oscar_cli.serve.sglang.settings import read_settings


def test_parse_names_keeps_the_order_given_and_refuses_unknown_names():
    assert parse_names(" oscar, flashinfer ,", CONFIGS, "configuration") == ("oscar", "flashinfer")
    for spec, words in (("oscar,vllm", "unknown configuration vllm; choose from flashinfer"),
                        (" , ", "unknown configuration ' , '")):
        with pytest.raises(ValueError, match=words):
            parse_names(spec, CONFIGS, "configuration")


def test_decode_tuning_is_kept_in_one_form_and_refused_with_one_line(tmp_path):
    """``--decode-tuning`` as BenchConfig keeps it: the keys given in DecodeOptions' field order, values as they parse
    (defaults included: they override a configuration's own options)."""
    assert tuning_label(" split_tokens=4096, movmatrix=False ,lean_tiles=true") == \
        "lean_tiles=true,movmatrix=false,split_tokens=4096"
    assert tuning_label("") == "" and tuning_label(" , ") == ""
    cfg = BenchConfig(out=tmp_path, configs=("oscar",), decode_tuning="split_tokens=4096,int8_scores=true")
    assert cfg.decode_tuning == "int8_scores=true,split_tokens=4096"
    for spec, words in (("lean=1", "--decode-tuning 'lean=1': expected KEY=VALUE"),
                        ("split_tokens=0", "split_tokens must be a positive integer")):
        with pytest.raises(BenchError) as e:
            BenchConfig(out=tmp_path, configs=("oscar",), decode_tuning=spec)
        assert words in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(BenchError, match="--decode-tuning applies to the oscar configurations"):
        BenchConfig(out=tmp_path, configs=("flashinfer",), decode_tuning="split_tokens=4096")


def test_tuned_sets_the_items_over_each_oscar_configurations_own_options():
    pv_lean = tuned(CONFIGS["oscar-int8-pv-lean"], "movmatrix=false,split_tokens=4096")
    assert pv_lean.name == "oscar-int8-pv-lean+movmatrix=false,split_tokens=4096"
    assert pv_lean.kv == "INT2 g128 s64/r256, int8 scores and values, lean tiles, fused update, movmatrix, " \
        "movmatrix=false, split_tokens=4096"
    assert pv_lean.decode == DecodeOptions(int8_scores=True, int8_values=True, lean_tiles=True, fused_update=True,
                                           split_tokens=4096)
    assert tuned(CONFIGS["oscar"], "int8_scores=true").decode == CONFIGS["oscar-int8"].decode
    assert tuned(CONFIGS["oscar"], "") is CONFIGS["oscar"]
    assert tuned(CONFIGS["flashinfer"], "split_tokens=4096") is CONFIGS["flashinfer"]  # baselines run as they are


def test_bench_config_refuses_contexts_that_do_not_fit(tmp_path):
    with pytest.raises(BenchError, match="--context-length 65536"):
        BenchConfig(out=tmp_path, context_length=65536)
    cfg = BenchConfig(out=tmp_path, configs=("oscar", "flashinfer"), measures=("latency", "profile", "capacity"))
    assert cfg.configs == ("flashinfer", "oscar")  # baselines first
    assert cfg.measures == ("capacity", "profile", "latency")  # the profile reuses the throughput's prefix


def test_generated_model_and_artifact_pass_the_plugins_checks(qwen):
    from oscar_cli.artifact import load_artifact
    from oscar_cli.serve.sglang.refusals import ModelFacts, model_refusals

    out, model, art = qwen
    cfg = json.loads((model / "config.json").read_text())
    assert {k: cfg[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                "head_dim", "intermediate_size", "vocab_size", "rope_theta",
                                "max_position_embeddings")} == {
        "num_hidden_layers": 36, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936, "rope_theta": 1e6,
        "max_position_embeddings": 131072}
    a = load_artifact(art, model_fingerprint(QWEN3_8B_SHAPED))
    s = a.scheme
    assert (s.bits, s.group, s.sink, s.recent) == (2, 128, 64, 256)
    assert torch.equal(a.tensors["clip_k"], torch.ones(36, 1)) and torch.equal(a.tensors["clip_v"], torch.ones(36, 1))
    for key in ("r_k", "r_v"):
        r = a.tensors[key][:, 0].double()
        torch.testing.assert_close(r @ r.transpose(-1, -2), torch.eye(128, dtype=torch.float64).expand(36, 128, 128),
                                   atol=1e-5, rtol=0)
    assert not torch.allclose(a.tensors["r_k"][0], a.tensors["r_k"][1])  # one rotation per layer
    assert not torch.allclose(a.tensors["r_k"], a.tensors["r_v"])

    problems, notes = model_refusals(a.manifest, ModelFacts.from_folder(model), 1, "dummy")
    assert problems == [] and any("fingerprint matches" in n for n in notes)
    check = check_with_plugin(model, art, max_running_requests=64, context_length=131072)
    assert check["cell_bytes"] == 36 * 2 * 8 * (128 // 4 + 2 * 2) == 20736
    assert check["bf16_cell_bytes"] == 36 * 2 * 8 * 128 * 2
    assert check["scheme"] == "int2.g128.s64.r256"
    assert prepare_model(out, model)[1] == art  # reused, not rewritten


def test_plugin_refuses_a_folder_of_another_model(qwen, tmp_path):
    import shutil

    from oscar_cli.models import FINGERPRINT_FILE
    from oscar_cli.serve.sglang.refusals import ServeRefusal

    _, model, art = qwen
    other = tmp_path / "other"
    shutil.copytree(model, other)
    (other / FINGERPRINT_FILE).write_text(json.dumps({"fingerprint": "sha256:someone-else"}))
    with pytest.raises(ServeRefusal, match="fingerprint"):
        check_with_plugin(other, art, max_running_requests=64, context_length=131072)


def test_server_argv_goes_through_build_launch_and_keeps_baselines_plugin_free(qwen, tmp_path):
    from oscar_cli.serve.sglang.refusals import ServeRefusal

    _, model, art = qwen
    cfg = BenchConfig(out=tmp_path)
    argv, env = server_argv(CONFIGS["oscar"], cfg, model, art, tmp_path / "p")
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    for flag, value in (("--attention-backend", "oscar"), ("--radix-cache-backend", "oscar"),
                        ("--load-format", "dummy"), ("--mem-fraction-static", "0.85"),
                        ("--context-length", "131072"), ("--sampling-backend", "pytorch"),
                        ("--max-running-requests", "64")):
        assert argv[argv.index(flag) + 1] == value, flag
    assert "--kv-cache-dtype" not in argv and json.loads(flags["--json-model-override-args"])["oscar"]["artifact"] \
        == str(art.resolve())
    assert env["SGLANG_PLUGINS"] == "oscar" and env["SGLANG_TORCH_PROFILER_DIR"] == str((tmp_path / "p").resolve())
    fp8, env8 = server_argv(CONFIGS["flashinfer-fp8"], cfg, model, None, tmp_path / "p")
    assert fp8[fp8.index("--kv-cache-dtype") + 1] == "fp8_e4m3" and fp8[fp8.index("--attention-backend") + 1] == \
        "flashinfer"
    assert env8["SGLANG_PLUGINS"] == "none" and "OSCAR_BENCH_NULL_FILL" not in env8
    null = BenchConfig(out=tmp_path, fill="null")  # the benchmark plugin beside oscar's, or alone
    flag = str((tmp_path / NULL_FILL_FLAG).resolve())
    _, env_o = server_argv(CONFIGS["oscar"], null, model, art, tmp_path / "p")
    _, env_b = server_argv(CONFIGS["flashinfer"], null, model, None, tmp_path / "p")
    assert env_o["SGLANG_PLUGINS"] == "oscar,oscar_bench_fill" and env_o["OSCAR_BENCH_NULL_FILL"] == flag
    assert env_b["SGLANG_PLUGINS"] == "oscar_bench_fill" and env_b["OSCAR_BENCH_NULL_FILL"] == flag

    for name, config in CONFIGS.items():  # each oscar configuration's decode options, through the plugin's settings
        if config.backend == "oscar":
            argv, env = server_argv(config, cfg, model, art, tmp_path / "p")
            settings = read_settings(argv[argv.index("--json-model-override-args") + 1])
            assert settings.decode == config.decode and env["SGLANG_PLUGINS"] == "oscar", name
    assert CONFIGS["oscar"].decode == DecodeOptions()
    assert CONFIGS["oscar-int8"].decode == DecodeOptions(int8_scores=True)
    assert CONFIGS["oscar-int8-pv"].decode == DecodeOptions(int8_scores=True, int8_values=True)
    assert CONFIGS["oscar-lean"].decode == DecodeOptions(lean_tiles=True, movmatrix=True)
    assert CONFIGS["oscar-int8-pv-lean"].decode == DecodeOptions(int8_scores=True, int8_values=True, lean_tiles=True,
                                                                 fused_update=True, movmatrix=True)
    bf16, _ = server_argv(CONFIGS["triton"], cfg, model, None, tmp_path / "p")
    assert "--kv-cache-dtype" not in bf16
    with pytest.raises(ServeRefusal, match="--kv-cache-dtype"):  # the plugin's own refusal, through build_launch
        server_argv(CONFIGS["oscar"], BenchConfig(out=tmp_path, extra=("--kv-cache-dtype", "fp8_e4m3")),
                    model, art, tmp_path / "p")
