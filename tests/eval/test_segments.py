"""The ``oscar_ppl`` text cut into segments."""

import pytest
import torch

from oscar_cli.config import EvalConfig
from oscar_cli.eval import EvalError
from oscar_cli.eval.segments import ppl_steps, ppl_text, segments_of, segments_per_length, token_ids


def test_segments_are_consecutive_and_limited():
    ids = torch.arange(1000)
    segs = segments_of(ids, 96, 3)
    assert segs.shape == (3, 96) and torch.equal(segs.flatten(), ids[:288])
    assert segments_of(ids, 96, None).shape == (10, 96)  # no limit: every whole segment, the rest dropped
    with pytest.raises(EvalError, match="10 tokens, fewer than one segment of 64") as e:
        segments_of(torch.arange(10), 64, None)
    assert "\n" not in str(e.value)


def test_text_and_progress_units(kit, tmp_path):
    tok = kit.tokenizer()
    data = tmp_path / "t.txt"
    data.write_text(kit.text(300))
    ids = token_ids(tok, data.read_text())
    assert ids.dtype == torch.long and ids.numel() == 300  # one id per word, no special tokens
    cfg = EvalConfig(tasks=("oscar_ppl",), seq_lengths=(64, 128), data=data)
    assert torch.equal(ppl_text(cfg, tok), ids)
    assert segments_per_length(cfg) == 4 and ppl_steps(cfg, ids) == 4 + 2  # 300 tokens hold two of 128
    assert ppl_steps(EvalConfig(tasks=("oscar_ppl",), seq_lengths=(64,), limit=1), ids) == 1
    assert ppl_text(EvalConfig(tasks=("niah_single_1",)), tok) is None
