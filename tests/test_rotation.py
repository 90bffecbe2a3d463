import math

import pytest
import torch

from oscar_cli import rotation as rot


@pytest.mark.parametrize("d", [64, 80, 96, 128, 12, 20, 112, 160, 192])
def test_hadamard_is_orthogonal_with_unit_modulus_entries(d):
    h = rot.hadamard(d, torch.float64)
    torch.testing.assert_close(h @ h.T, torch.eye(d, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(h.abs(), torch.full((d, d), 1 / math.sqrt(d), dtype=torch.float64))


def test_unsupported_order_raises_and_mixing_falls_back_to_dct():
    with pytest.raises(ValueError, match="no Hadamard construction"):
        rot.hadamard(6 * 7)
    m, kind = rot.mixing_matrix(42, 42)
    assert kind == "dct"
    assert rot.orthogonality_error(m) < 1e-12


def test_block_mixing_is_block_diagonal():
    m, kind = rot.mixing_matrix(64, 16)
    assert kind == "hadamard"
    assert m[:16, 16:].abs().max() == 0 and m[16:32, :16].abs().max() == 0
    assert rot.orthogonality_error(m) < 1e-12


@pytest.mark.parametrize("d", [8, 64, 80, 96, 128])
def test_placement_is_the_bit_reversal_permutation(d):
    p = rot.placement(d)
    assert torch.equal(p.sum(0), torch.ones(d, dtype=torch.float64))
    assert torch.equal(p.sum(1), torch.ones(d, dtype=torch.float64))
    br = rot.bit_reversal(d)
    assert sorted(br.tolist()) == list(range(d))
    for i in range(d):  # P[:, br(i)] = e_i
        assert torch.equal(p[:, br[i]], torch.eye(d, dtype=torch.float64)[i])


def test_bit_reversal_power_of_two():
    assert rot.bit_reversal(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    assert rot.bit_reversal(16)[1].item() == 8


def _planted(d, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    lam = torch.logspace(2, -2, d, dtype=torch.float64)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) * lam.sqrt() @ q.T
    return x, q, lam


def test_fitting_recovers_a_planted_eigenbasis():
    x, q, lam = _planted(32, 200_000)
    evals, u = rot.eigh_desc(x.T @ x / x.shape[0])
    torch.testing.assert_close(evals, lam, rtol=0.03, atol=0)
    overlap = (u.T @ q).abs()  # columns match up to sign, in descending-eigenvalue order
    assert overlap.diagonal()[:8].min() > 0.99


@pytest.mark.parametrize("use_u,use_p,use_h,signs", [(1, 1, 1, 0), (1, 0, 1, 0), (1, 0, 0, 0), (0, 0, 1, 1)])
@pytest.mark.parametrize("d,group", [(64, 64), (64, 16), (80, 80), (96, 32)])
def test_composed_rotation_is_orthogonal(use_u, use_p, use_h, signs, d, group):
    x, _, _ = _planted(d, 4096, seed=d)
    r = rot.compose(x.T @ x / 4096, use_u=bool(use_u), use_p=bool(use_p), use_h=bool(use_h), group=group,
                    signs_seed=0 if signs else None)
    assert rot.orthogonality_error(r.float()) < 1e-5


def test_upph_puts_the_leading_eigenvector_where_bit_reversal_says():
    x, q, _ = _planted(16, 100_000, seed=3)
    cov = x.T @ x / x.shape[0]
    up = rot.compose(cov, use_u=True, use_p=True, use_h=False, group=16)
    u = rot.eigh_desc(cov)[1]
    br = rot.bit_reversal(16)
    for i in range(16):
        torch.testing.assert_close(up[:, br[i]], u[:, i])


def test_anchored_basis_puts_the_anchor_first_and_stays_orthogonal():
    x, _, _ = _planted(16, 20_000, seed=4)
    offset = torch.zeros(16, dtype=torch.float64)
    offset[3] = 20.0
    keys = x + offset  # a large shared offset along e_3
    anchor = keys.T @ keys / keys.shape[0]
    cq = x.T @ x / x.shape[0]
    evals, u = rot.anchored_eigh(anchor, cq)
    assert rot.orthogonality_error(u) < 1e-12
    assert u[:, 0].abs().argmax().item() == 3 and u[3, 0].abs() > 0.99
    torch.testing.assert_close(evals[0], u[:, 0] @ cq @ u[:, 0])
    assert (evals[1:].diff() <= 1e-12).all()


def test_anchor_lands_on_the_constant_hadamard_row_and_costs_nothing():
    """Rows that are a constant offset along the anchor quantize exactly after U·P·H (the zero point absorbs it)."""
    x, _, _ = _planted(16, 4096, seed=5)
    a = torch.randn(16, dtype=torch.float64)
    a /= a.norm()
    r = rot.compose(x.T @ x, use_u=True, use_p=True, use_h=True, group=16, anchor=torch.outer(a, a) * 100 + torch.eye(16) * 1e-3)
    y = (5.0 * a) @ r
    torch.testing.assert_close(y, torch.full_like(y, y[0].item()), atol=1e-9, rtol=0)
