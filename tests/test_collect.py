import numpy as np
import pytest
import torch

from oscar_cli.collect import Reservoir
from oscar_cli.config import AttentionShape
from oscar_cli.stats import KINDS, StatsAccumulator

SHAPE = AttentionShape(n_layers=2, n_heads=6, n_kv_heads=2, head_dim=8)


def _batch(seed, B=2, T=12):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 6, T, 8, generator=g)
    k = torch.randn(B, 2, T, 8, generator=g) * torch.linspace(0.2, 3, 8)
    v = torch.randn(B, 2, T, 8, generator=g)
    o = torch.randn(B, 6, T, 8, generator=g)
    return q, k, v, o


def _one_shot(batches, layer, skip):
    """Float64 reference: concatenate everything, compute each target directly."""
    H, G = 2, 3
    qs, ks, vs, os_ = ([b[i][:, :, skip:].double() for b in batches] for i in range(4))
    ref = {}
    q = torch.cat([x.unflatten(1, (H, G)).permute(1, 0, 2, 3, 4).reshape(H, -1, 8) for x in qs], 1)
    o = torch.cat([x.unflatten(1, (H, G)).permute(1, 0, 2, 3, 4).reshape(H, -1, 8) for x in os_], 1)
    k = torch.cat([x.transpose(0, 1).reshape(H, -1, 8) for x in ks], 1)
    v = torch.cat([x.transpose(0, 1).reshape(H, -1, 8) for x in vs], 1)
    for name, rows in (("q", q), ("k", k), ("v", v), ("o", o)):
        ref[name] = rows.transpose(1, 2) @ rows / rows.shape[1]
    # C_S: w_t uses the running C_Q after the batch that holds token t (see collect.py)
    num = torch.zeros(H, 8, 8, dtype=torch.float64)
    den = torch.zeros(H, dtype=torch.float64)
    seen_q = [x.unflatten(1, (H, G)).permute(1, 0, 2, 3, 4).reshape(H, -1, 8) for x in qs]
    for i in range(len(batches)):
        qq = torch.cat(seen_q[: i + 1], 1)
        cq = qq.transpose(1, 2) @ qq / qq.shape[1]
        kb = ks[i].transpose(0, 1).reshape(H, -1, 8)
        vb = vs[i].transpose(0, 1).reshape(H, -1, 8)
        w = torch.einsum("hnd,hde,hne->hn", kb, cq, kb)
        num += torch.einsum("hn,hnd,hne->hde", w, vb, vb)
        den += w.sum(1)
    ref["s"] = num / den[:, None, None]
    return ref


def test_streamed_statistics_equal_one_shot_float64():
    batches = [_batch(s) for s in range(4)]
    acc = StatsAccumulator(SHAPE, skip=3)
    for b in batches:
        for layer in range(2):
            acc.update(layer, *b)
    ref = _one_shot(batches, 0, skip=3)
    for kind in KINDS:
        torch.testing.assert_close(acc.covariance(kind)[0], ref[kind], rtol=1e-12, atol=1e-12)


def test_accumulator_round_trips_through_rows():
    acc = StatsAccumulator(SHAPE)
    acc.update(1, *_batch(7))
    other = StatsAccumulator(SHAPE)
    other.load_rows(acc.as_rows())
    for kind in KINDS:
        assert torch.equal(other.sums[kind], acc.sums[kind])
        assert torch.equal(other.count[kind], acc.count[kind])
        assert torch.equal(other.weight[kind], acc.weight[kind])


def test_accumulators_follow_the_rows_device():
    """A CUDA model's rows accumulate on the GPU: the first update moves the accumulators to the rows' device
    (``meta`` stands in for CUDA on a CPU machine; with the accumulators left on the CPU this update raises the
    device mismatch a CUDA collect hit)."""
    acc = StatsAccumulator(SHAPE)
    assert acc.device.type == "cpu"
    acc.update(0, *(t.to("meta") for t in _batch(1)))
    assert acc.device.type == "meta"
    assert {t.device.type for d in (acc.sums, acc.count, acc.weight) for t in d.values()} == {"meta"}
    assert {t.dtype for d in (acc.sums, acc.count, acc.weight) for t in d.values()} == {torch.float64}


def test_low_precision_rows_accumulate_in_float64():
    """Rows of any float dtype (a bf16 model's) are widened before their products: the accumulators stay float64 and
    equal those of the same values given as float64 rows (bf16 products would round each term)."""
    rows = [tuple(t.bfloat16() for t in _batch(s)) for s in (2, 3)]
    low, wide = StatsAccumulator(SHAPE), StatsAccumulator(SHAPE)
    for b in rows:
        low.update(1, *b)
        wide.update(1, *(t.double() for t in b))
    assert {t.dtype for d in (low.sums, low.count, low.weight) for t in d.values()} == {torch.float64}
    assert low.digest() == wide.digest()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_statistics_read_back_equal_a_cpu_run():
    """Accumulated on the GPU, the statistics leave the accumulator on the CPU (rows, digest) equal to a CPU run's."""
    gpu, cpu = StatsAccumulator(SHAPE), StatsAccumulator(SHAPE)
    for s in (4, 5):
        gpu.update(1, *(t.double().cuda() for t in _batch(s)))
        cpu.update(1, *(t.double() for t in _batch(s)))
    assert gpu.device.type == "cuda"
    rows_gpu, rows_cpu = gpu.as_rows(), cpu.as_rows()
    for key, (count, weight, mat) in rows_cpu.items():  # float64 sums in another order: equal to ~1e-15
        assert rows_gpu[key][0] == count and rows_gpu[key][1] == pytest.approx(weight, rel=1e-12, abs=0)
        np.testing.assert_allclose(rows_gpu[key][2], mat, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gpu.covariance("s").cpu(), cpu.covariance("s"), rtol=1e-12, atol=1e-12)


def test_reservoir_keeps_the_smallest_priorities_whatever_the_batching():
    r = Reservoir(size=20, seed=5)
    kept = []
    for b in range(6):
        pri = r.batch_priorities(b, (2, 10))
        valid = torch.ones(2, 10, dtype=torch.bool)
        keep, thr = r.admit(pri, valid)
        kept.append(pri[keep])
        assert (pri[keep] <= thr).all()
    all_pri = torch.cat([r.batch_priorities(b, (2, 10)).flatten() for b in range(6)])
    expect = np.sort(all_pri.numpy())[:20]
    np.testing.assert_array_equal(r.priorities, expect)
    # a fresh reservoir restored from the kept priorities continues identically
    r2 = Reservoir(size=20, seed=5)
    r2.priorities = np.sort(torch.cat([r.batch_priorities(b, (2, 10)).flatten() for b in range(3)]).numpy())[:20]
    for b in range(3, 6):
        r2.admit(r2.batch_priorities(b, (2, 10)), torch.ones(2, 10, dtype=torch.bool))
    np.testing.assert_array_equal(r2.priorities, r.priorities)
