import pytest
import torch

from oscar_cli.config import FitConfig, QuantScheme
from oscar_cli.fit import LayerData, fit_layer, fit_rotations, key_distortion, value_distortion
from oscar_cli.kvquant import data_free_rotation
from oscar_cli.methods import ROTATIONS
from oscar_cli.rotation import orthogonality_error


def _layer(n=512, H=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(1, -1, d)
    # Student-t with 3 degrees of freedom (heavy tails: clipping pays), drawn from the seeded generator
    chi2 = torch.randn(3, n, H, d, generator=g).square().sum(0)
    k = torch.randn(n, H, d, generator=g) / (chi2 / 3).sqrt() * scales
    v = torch.randn(n, H, d, generator=g) * scales.flip(0)
    q = torch.randn(4 * n, H, d, generator=g) * torch.linspace(0.1, 2, d)
    def cov(x):
        x = x.double()
        return torch.einsum("nhd,nhe->hde", x, x) / x.shape[0]
    return LayerData(cq=cov(q), ck=cov(k), cv=cov(v), cs=cov(v), co=cov(v), k_rows=k.float(), v_rows=v.float())


@pytest.mark.parametrize("method", sorted(ROTATIONS))
@pytest.mark.parametrize("per_head", [False, True])
def test_every_method_gives_orthogonal_rotations(method, per_head):
    data = _layer()
    f = fit_layer(data, FitConfig(method=method, per_head=per_head, scheme=QuantScheme(sink=0, recent=0)), 16)
    assert f.r_k.shape == f.r_v.shape == ((2 if per_head else 1), 16, 16)
    for r in (*f.r_k, *f.r_v):
        assert orthogonality_error(r.float()) < 1e-5
    assert ((0 < f.clip_k) & (f.clip_k <= 1)).all()


@pytest.mark.parametrize("name", ["identity", "hadamard"])
def test_data_free_recipes_fit_the_matrix_the_kv_methods_use(name):
    """A data-free recipe fitted (``oscar fit --method hadamard``) gives exactly the rotation the data-free KV methods
    build from the same registry entry (``int2-hadamard``), shared or per head; eigenvalues play no part."""
    for per_head in (False, True):
        r_k, r_v, _, _ = fit_rotations(_layer(), ROTATIONS[name], 8, per_head)
        want = data_free_rotation(ROTATIONS[name], 16, 8)
        want = torch.eye(16, dtype=torch.float64) if want is None else want
        assert r_k.shape[0] == (2 if per_head else 1)
        for r in (*r_k, *r_v):
            assert torch.equal(r, want)


def test_fitted_clip_beats_plain_min_max_on_held_out_rows():
    data = _layer(seed=1)
    f = fit_layer(data, FitConfig(method="hadamard"), 16)
    _, held = data.split()
    plain = key_distortion(held, f.r_k, torch.ones(1, 1, dtype=torch.float64), 2, 16).mean()
    fitted = key_distortion(held, f.r_k, f.clip_k.view(1, -1), 2, 16).mean()
    assert f.clip_k.item() < 1.0
    assert fitted < plain


def test_oscar_beats_identity_and_reports_consistent_metrics():
    f = fit_layer(_layer(seed=2), FitConfig(method="oscar"), 16)
    m = f.metrics
    for kv in ("distortion_k", "distortion_v"):
        assert m[kv]["artifact"] < m[kv]["identity"]
        assert m[kv]["hadamard_clip"] <= m[kv]["hadamard"] * 1.05
    assert m["orthogonality_error"] < 1e-12
    assert len(m["clip_curve_k"]) == len(FitConfig().clip_grid)


def test_distortion_is_zero_without_quantization_error():
    data = _layer()
    eye = torch.eye(16, dtype=torch.float64)[None]
    # 4-bit of an exactly representable grid: rows on 16 levels -> exact round trip
    grid = torch.randint(0, 16, (64, 2, 16)).float()
    grid[:, :, 0], grid[:, :, 1] = 0, 15
    exact = LayerData(data.cq, data.ck, data.cv, data.cs, data.co, grid, grid)
    one = torch.ones(1, 1, dtype=torch.float64)
    assert key_distortion(exact, eye, one, 4, 16).abs().max() < 1e-12
    assert value_distortion(exact, eye, one, 4, 16).abs().max() < 1e-12
