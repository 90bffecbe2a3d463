"""The benchmark plugin's hook (``oscar bench --fill null``) on CPU: which forwards it skips and what it returns.
SGLang's own classes are not importable here; the hook target and the two output classes' fields are checked against
the released source in ``test_sglang_contract.py``. Nothing here ran inside an SGLang server."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from oscar_cli.serve.sglang import bench_fill


@dataclass
class LogitsOut:  # the fields of sglang.srt.layers.logits_processor.LogitsProcessorOutput the hook fills
    next_token_logits: torch.Tensor | None
    hidden_states: torch.Tensor | None = None


@dataclass
class RunnerOut:  # sglang.srt.model_executor.model_runner.ModelRunnerOutput
    logits_output: LogitsOut
    can_run_graph: bool


def batch(extend: bool, n: int = 3):
    mode = SimpleNamespace(is_extend=lambda include_draft_extend_v2=False: extend)
    return SimpleNamespace(forward_mode=mode, batch_size=n, seq_lens=torch.full((n,), 7))


def test_only_extends_are_skipped_and_only_while_the_flag_exists(tmp_path, monkeypatch):
    flag = tmp_path / "null-fill.flag"
    monkeypatch.setenv(bench_fill.FLAG_ENV, str(flag))
    assert not bench_fill.null_fill_active(batch(True))  # no flag file yet
    flag.touch()
    assert bench_fill.null_fill_active(batch(True)) and not bench_fill.null_fill_active(batch(False))
    monkeypatch.delenv(bench_fill.FLAG_ENV)
    assert not bench_fill.null_fill_active(batch(True))  # the variable names the flag: unset, nothing is skipped


def test_a_skipped_extend_returns_zero_logits_of_the_batch(tmp_path, monkeypatch):
    runner = SimpleNamespace(model_config=SimpleNamespace(vocab_size=11))
    out = bench_fill.null_output(runner, batch(True, 4), (LogitsOut, RunnerOut))
    assert out.can_run_graph is False and out.logits_output.hidden_states is None
    logits = out.logits_output.next_token_logits
    assert logits.shape == (4, 11) and logits.dtype == torch.float32 and not logits.any()


def test_the_hook_calls_the_real_forward_otherwise(tmp_path, monkeypatch):
    calls = []

    def original(runner, fb, *args, **kwargs):
        calls.append((fb, args, kwargs))
        return "real"

    monkeypatch.setenv(bench_fill.FLAG_ENV, str(tmp_path / "absent.flag"))
    fb = batch(True)
    assert bench_fill.around_forward(original, object(), fb, None, reinit_attn_backend=True) == "real"
    assert calls == [(fb, (None,), {"reinit_attn_backend": True})]
    (tmp_path / "absent.flag").touch()
    monkeypatch.setattr(bench_fill, "null_output", lambda runner, fb_: ("null", fb_))
    assert bench_fill.around_forward(original, object(), fb) == ("null", fb) and len(calls) == 1
    assert bench_fill.around_forward(original, object(), batch(False)) == "real" and len(calls) == 2
