"""Perplexity of text segments through a prepared model: teacher-forced, and decoded through the cache."""

import math

import pytest
import torch

from oscar_cli.config import QuantScheme
from oscar_cli.eval.perplexity import perplexity
from oscar_cli.eval.segments import segments_of, token_ids
from oscar_cli.methods import get_method, scheme_for
from oscar_cli.prepare import head_dim_of, prepare


def prep(model, name, sink, recent, artifact=None):
    m = get_method(name)
    scheme = scheme_for(m, head_dim_of(model.config), reference=QuantScheme(sink=sink, recent=recent),
                        artifact_scheme=None if artifact is None else artifact.scheme)
    return prepare(model, m, scheme, artifact)


def test_perplexity_bf16_matches_cross_entropy_and_quantization_hurts(kit):
    model, tok = kit.llama(), kit.tokenizer()
    segs = segments_of(token_ids(tok, kit.text(300)), 96, 3)
    steps = []
    p_bf16 = perplexity(model, segs, prep(model, "bf16", 4, 8), advance=lambda: steps.append(1))
    assert len(steps) == 3
    with torch.no_grad():
        logits = model(segs).logits[:, :-1]
    ref = math.exp(torch.nn.functional.cross_entropy(logits.reshape(-1, 96), segs[:, 1:].reshape(-1)).item())
    assert p_bf16 == pytest.approx(ref, rel=1e-5)
    p_full_recent = perplexity(model, segs, prep(model, "int2-naive", 4, 96))
    assert p_full_recent == pytest.approx(p_bf16, rel=1e-5)
    p_naive = perplexity(model, segs, prep(model, "int2-naive", 4, 8))
    assert p_naive != pytest.approx(p_bf16, rel=1e-4)
    # decoding token by token through the method's cache computes the same number
    assert perplexity(model, segs[:1], prep(model, "int2-naive", 4, 8), decode=True) == pytest.approx(
        perplexity(model, segs[:1], prep(model, "int2-naive", 4, 8)), rel=1e-4)


@pytest.mark.slow
def test_embedded_default_ordering_on_heldout_text(embedded_store, embedded_artifact):
    """One 1k segment of the held-out text, sink 16 / recent 64:
    bf16 < oscar < int2-hadamard-clip < int2-hadamard < int2-naive."""
    from oscar_cli.artifact import load_artifact
    from oscar_cli.data import heldout_text
    from oscar_cli.models import load_model

    lm = load_model("smollm2-135m", embedded_store)
    art = load_artifact(embedded_artifact, lm.fingerprint)
    segs = segments_of(token_ids(lm.tokenizer, heldout_text()), 1024, 1)
    ppl = {m: perplexity(lm.model, segs, prep(lm.model, m, 16, 64, art if m == "oscar" else None))
           for m in ["bf16", "oscar", "int2-hadamard-clip", "int2-hadamard", "int2-naive"]}
    assert ppl["bf16"] < ppl["oscar"] < ppl["int2-hadamard-clip"] < ppl["int2-hadamard"] < ppl["int2-naive"], ppl
