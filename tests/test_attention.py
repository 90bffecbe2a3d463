"""Decode-equivalent attention against a per-query brute force, and its registration with transformers."""

import math

import pytest
import torch
from oscar_kernels.scheme import DecodeOptions

from oscar_cli import attention as attn
from oscar_cli.config import QuantScheme
from oscar_cli.kvquant import build_layer_quants, roundtrip
from oscar_cli.methods import get_method, scheme_for


def SinkRecent(sink, recent):  # noqa: N802
    return QuantScheme(sink=sink, recent=recent)


def lq_for(name, n_layers, d, h):
    m = get_method(name)
    return build_layer_quants(m, scheme_for(m, d), n_layers, d, h)


def brute_force(q, k, v, lq, w, first):
    """Query by query: build the keys a decoder at that step reads, then softmax."""
    B, Hq, n, d = q.shape
    rep = Hq // k.shape[1]
    k_rt, v_rt = roundtrip(k, lq, "k"), roundtrip(v, lq, "v")
    out = torch.zeros(B, n, Hq, d)
    for b in range(B):
        for t in range(first[b], n):
            ks, vs = k[b, :, first[b] : t + 1].clone(), v[b, :, first[b] : t + 1].clone()
            for j in range(first[b], t + 1):
                if j - first[b] >= w.sink and j <= t - w.recent:
                    ks[:, j - first[b]], vs[:, j - first[b]] = k_rt[b, :, j], v_rt[b, :, j]
            ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
            p = torch.softmax(q[b, :, t : t + 1] @ ks.transpose(-1, -2) / math.sqrt(d), -1)
            out[b, t] = (p @ vs)[:, 0]
    return out


@pytest.mark.parametrize("name", ["int2-naive", "int2-hadamard-clip"])
def test_decode_equivalent_matches_brute_force_with_left_padding(name):
    g = torch.Generator().manual_seed(3)
    B, n, d = 2, 40, 16
    q, k, v = (torch.randn(B, h, n, d, generator=g) for h in (4, 2, 2))
    lq = lq_for(name, 1, d, 2)[0]
    w = SinkRecent(sink=3, recent=7)
    first = [0, 5]  # row 1 is left-padded by 5
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))[None, None].repeat(B, 1, 1, 1)
    allowed[1, :, :, :5] = False
    out = attn.decode_equivalent(q, k, v, allowed, 1 / math.sqrt(d), lq, w)
    ref = brute_force(q, k, v, lq, w, first)
    torch.testing.assert_close(out[0], ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, 5:], ref[1, 5:], atol=1e-5, rtol=1e-5)
    exact = attn.mixed_attention(q, k, v, allowed, 1 / math.sqrt(d))
    assert (out[0, 20:] - exact[0, 20:]).abs().max() > 1e-3  # quantization is visible in the middle


def test_int8_scores_match_a_brute_force_of_the_kernel_definition():
    """With ``int8_scores`` a query's score over an INT2 key is ``round8(q R).(k' - z) + (q R).z`` (``k'`` the
    dequantised rotated key, ``z`` its zero, ``round8`` each head's rotated query to steps of max / 127: the decode
    kernel's ``int8_scores`` and ``decode_int2_ref(int8_scores=True)``); exact keys keep the exact query."""
    import dataclasses

    from oscar_cli.kvquant import quantize_rows
    from oscar_cli.quantizer import dequantize

    g = torch.Generator().manual_seed(5)
    B, n, d = 1, 30, 16
    q, k, v = (torch.randn(B, h, n, d, generator=g) * 2 for h in (4, 2, 2))
    lq = dataclasses.replace(lq_for("int2-hadamard-clip", 1, d, 2)[0], decode=DecodeOptions(int8_scores=True))
    w = SinkRecent(sink=2, recent=5)
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))[None, None]
    out = attn.decode_equivalent(q, k, v, allowed, 1 / math.sqrt(d), lq, w)
    rows = quantize_rows(k, lq, "k")
    kr = dequantize(rows)  # rotated basis
    z = rows.zero.float().repeat_interleave(rows.group, -1)
    v_rt = roundtrip(v, lq, "v")
    r = lq.r_k[0]
    ref = torch.zeros(B, n, 4, d)
    for t in range(n):
        for h in range(4):
            kh = h // 2
            qr = q[0, h, t] @ r
            q8 = attn.int8_rounded(qr)
            s, vals = [], []
            for j in range(t + 1):
                if w.sink <= j <= t - w.recent:
                    s.append(q8 @ (kr[0, kh, j] - z[0, kh, j]) + qr @ z[0, kh, j])
                    vals.append(v_rt[0, kh, j])
                else:
                    s.append(q[0, h, t] @ k[0, kh, j])
                    vals.append(v[0, kh, j])
            p = torch.softmax(torch.stack(s) / math.sqrt(d), 0)
            ref[0, t, h] = p @ torch.stack(vals)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    plain = attn.decode_equivalent(q, k, v, allowed, 1 / math.sqrt(d), dataclasses.replace(lq, decode=DecodeOptions()), w)
    assert (out - plain).abs().max() > 1e-4  # the rounding is visible
    torch.testing.assert_close(out, plain, atol=0.25, rtol=0.25)


@pytest.mark.parametrize("int8_scores", [False, True])
def test_int8_values_match_the_kernel_definition_per_query(int8_scores):
    """With ``int8_values`` each query's INT2 rows (from the first one after the sink, tiles of 128) weigh their
    value codes by ``oscar_kernels.decode.int8_value_weights`` of their scores and scales, their zeros and the
    exact rows by the probabilities (the decode kernel's ``int8_values``); with ``int8_scores`` too the scores are
    the int8 ones. Checked per query against that function over more than two tiles, with a left-padded row."""
    import dataclasses

    from oscar_kernels.decode import int8_value_weights

    from oscar_cli.kvquant import quantize_rows

    g = torch.Generator().manual_seed(7)
    B, n, d = 2, 330, 16
    q, k, v = (torch.randn(B, h, n, d, generator=g) * 2 for h in (4, 2, 2))
    lq = dataclasses.replace(lq_for("int2-hadamard-clip", 1, d, 2)[0],
                             decode=DecodeOptions(int8_scores=int8_scores, int8_values=True))
    w = SinkRecent(sink=2, recent=5)
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))[None, None].repeat(B, 1, 1, 1)
    allowed[1, :, :, :3] = False  # row 1 left-padded by 3: its sink and INT2 list start 3 later
    out = attn.decode_equivalent(q, k, v, allowed, 1 / math.sqrt(d), lq, w)
    plain = attn.decode_equivalent(q, k, v, allowed, 1 / math.sqrt(d), dataclasses.replace(lq, decode=DecodeOptions(int8_scores=int8_scores)), w)
    codes, scale, zeros = attn.int8_value_parts(quantize_rows(v, lq, "v"), lq)
    v_rt = roundtrip(v, lq, "v")
    q_sc, k_sc = (attn.int8_query(q, lq.r_k), attn.int8_exact_keys(k)) if int8_scores else (q, k)
    k_rt = attn.int8_keys(quantize_rows(k, lq, "k")) if int8_scores else roundtrip(k, lq, "k")
    ref = torch.zeros(B, n, 4, d)
    for b in range(B):
        first = 3 * b
        for t in range(first, n, 7):
            for h in range(4):
                kh = h // 2
                int2 = torch.arange(first + w.sink, max(first + w.sink, t + 1 - w.recent))
                exact = torch.tensor([j for j in range(first, t + 1) if j not in set(int2.tolist())], dtype=torch.long)
                s_ex = k_sc[b, kh, exact] @ q_sc[b, h, t] / math.sqrt(d)
                s_rt = k_rt[b, kh, int2] @ q_sc[b, h, t] / math.sqrt(d)
                m = torch.cat([s_ex, s_rt]).max()
                p_ex, p_rt = torch.exp(s_ex - m), torch.exp(s_rt - m)
                wt = int8_value_weights(s_rt, scale[b, kh, int2], m)
                num = p_ex @ v[b, kh, exact] + wt @ codes[b, kh, int2] + p_rt @ zeros[b, kh, int2]
                ref[b, t, h] = num / (p_ex.sum() + p_rt.sum())
                if len(int2) == 0:
                    torch.testing.assert_close(ref[b, t, h], plain[b, t, h], atol=1e-5, rtol=1e-5)
                assert torch.allclose(p_rt @ (codes[b, kh, int2] * scale[b, kh, int2, None] + zeros[b, kh, int2])
                                      , p_rt @ v_rt[b, kh, int2], atol=1e-3)
        torch.testing.assert_close(out[b, first::7], ref[b, first::7], atol=1e-4, rtol=1e-4)
    real = torch.cat([out[0], out[1, 3:]]), torch.cat([plain[0], plain[1, 3:]])  # padding queries: any finite
    assert torch.isfinite(out).all() and (real[0] - real[1]).abs().max() > 1e-3  # the rounding is visible
    assert (real[0] - real[1]).norm() / real[1].norm() < 0.05


def test_recent_covering_everything_is_exact():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, h, 30, 16, generator=g) for h in (4, 2, 2))
    lq = lq_for("int2-naive", 1, 16, 2)[0]
    allowed = torch.tril(torch.ones(30, 30, dtype=torch.bool))[None, None]
    out = attn.decode_equivalent(q, k, v, allowed, 0.25, lq, SinkRecent(0, 30))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-6, rtol=1e-5)


def test_registered_attention_in_a_model(tiny_llama):
    model = tiny_llama(hidden=64)
    ids = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model(ids, use_cache=False).logits
        attn.install(model, None, None)  # exact everywhere: same logits as sdpa
        assert model.config._attn_implementation == attn.ATTN_NAME
        same = model(ids, use_cache=False).logits
        torch.testing.assert_close(same, base, atol=1e-5, rtol=1e-4)
        quants = lq_for("int2-naive", 2, 16, 2)
        attn.install(model, quants, SinkRecent(4, 8))
        q = model(ids, use_cache=False).logits
    # the first sink+recent positions see only exact keys; later ones do not
    torch.testing.assert_close(q[:, :12], base[:, :12], atol=1e-5, rtol=1e-4)
    assert (q[:, 20:] - base[:, 20:]).abs().max() > 1e-3
    assert torch.isfinite(q).all()


def test_ensure_installed_keeps_a_switched_model_and_switches_a_plain_one(tiny_llama):
    """What a cache that attends by itself calls: a plain model gets exact layers (same logits as sdpa); a model
    already switched keeps its quantizers."""
    model = tiny_llama(hidden=64)
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(ids, use_cache=False).logits
        attn.ensure_installed(model)
        assert attn.is_installed(model)
        torch.testing.assert_close(model(ids, use_cache=False).logits, base, atol=1e-5, rtol=1e-4)
        attn.install(model, lq_for("int2-naive", 2, 16, 2), SinkRecent(2, 4))
        quantized = model(ids, use_cache=False).logits
        attn.ensure_installed(model)
        assert torch.equal(model(ids, use_cache=False).logits, quantized)
    assert (quantized - base).abs().max() > 1e-3
