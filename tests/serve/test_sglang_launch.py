"""``build_launch``: the SGLang server argv and environment for an artifact, and its one-line refusals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from oscar_kernels.scheme import DecodeOptions

from oscar_cli.errors import OscarError
from oscar_cli.serve.sglang.launch import DEFAULT_MAX_RUNNING_REQUESTS, build_launch
from oscar_cli.serve.sglang.refusals import ServeRefusal
from oscar_cli.serve.sglang.settings import OscarSettings, SettingsError, read_settings


def value(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} appears {argv.count(flag)} times in {argv}"
    return argv[argv.index(flag) + 1]


def test_argv_and_environment(tmp_path):
    art = tmp_path / "artifacts" / "m" / "v1"
    argv, env = build_launch("/models/smollm2", art, "127.0.0.1", 30123, ["--cuda-graph-max-bs-decode", "16",
                                                                          "--sampling-backend", "pytorch"])
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert value(argv, "--model-path") == "/models/smollm2"
    assert (value(argv, "--host"), value(argv, "--port")) == ("127.0.0.1", "30123")
    assert value(argv, "--attention-backend") == "oscar"
    assert value(argv, "--radix-cache-backend") == "oscar"
    assert value(argv, "--max-running-requests") == str(DEFAULT_MAX_RUNNING_REQUESTS)
    assert read_settings(value(argv, "--json-model-override-args")) == OscarSettings(artifact=art.resolve())
    assert argv[-4:] == ["--cuda-graph-max-bs-decode", "16", "--sampling-backend", "pytorch"]
    assert env == {"SGLANG_PLUGINS": "oscar"}


def test_decode_options_go_into_the_settings(tmp_path):
    options = DecodeOptions(int8_scores=True, movmatrix=True, split_tokens=4096)
    argv, _ = build_launch("m", tmp_path, "h", 1, [], decode=options)
    text = value(argv, "--json-model-override-args")
    assert json.loads(text)["oscar"]["decode"] == {"int8_scores": True, "movmatrix": True, "split_tokens": 4096}
    assert read_settings(text) == OscarSettings(artifact=tmp_path.resolve(), decode=options)


def test_user_overrides_are_merged_and_user_limits_kept(tmp_path):
    user = json.dumps({"rope_scaling": {"type": "linear", "factor": 2.0}})
    argv, _ = build_launch("m", tmp_path, "0.0.0.0", 1, ["--json-model-override-args", user,
                                                         "--max-running-requests", "8", "--attention-backend", "oscar"])
    merged = json.loads(value(argv, "--json-model-override-args"))
    assert merged["rope_scaling"] == {"type": "linear", "factor": 2.0}
    assert merged["oscar"]["artifact"] == str(tmp_path.resolve())
    assert value(argv, "--max-running-requests") == "8"
    assert value(argv, "--attention-backend") == "oscar"


@pytest.mark.parametrize("extra, needle", [
    (["--attention-backend", "triton"], "--attention-backend triton"),
    (["--attention-backend=flashinfer"], "--attention-backend flashinfer"),
    (["--radix-cache-backend", "flexkv"], "--radix-cache-backend flexkv"),
    (["--kv-cache-dtype", "fp8_e4m3"], "--kv-cache-dtype fp8_e4m3"),
    (["--speculative-algorithm", "EAGLE"], "--speculative-algorithm EAGLE"),
    (["--enable-hierarchical-cache"], "--enable-hierarchical-cache"),
    (["--enable-mixed-chunk", "--log-level", "info"], "--enable-mixed-chunk"),
    (["--page-size", "16"], "--page-size 16"),
    (["--disaggregation-mode", "prefill"], "--disaggregation-mode prefill"),
    (["--cuda-graph-backend-prefill", "full"], "--cuda-graph-backend-prefill full"),
    (["--decode-attention-backend", "triton"], "--decode-attention-backend triton"),
    (["--model-path", "other"], "--model-path"),
    (["--port", "9"], "--port"),
])
def test_conflicting_extra_args_are_refused_with_one_line(tmp_path, extra, needle):
    with pytest.raises(ServeRefusal) as e:
        build_launch("m", tmp_path, "127.0.0.1", 30000, extra)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


def test_settings_given_twice_are_refused(tmp_path):
    with pytest.raises(SettingsError) as e:
        build_launch("m", tmp_path, "h", 1, ["--json-model-override-args", json.dumps({"oscar": {"artifact": "x"}})])
    assert isinstance(e.value, OscarError) and "already" in str(e.value)


def test_compatible_flags_pass_through(tmp_path):
    extra = ["--tp-size", "2", "--disable-radix-cache", "--kv-cache-dtype", "auto", "--page-size", "1",
             "--disaggregation-mode", "null", "--cuda-graph-backend-prefill", "breakable"]
    argv, _ = build_launch("m", Path(tmp_path), "h", 1, extra)
    assert argv[-len(extra):] == extra
