"""Rotations: normalised Hadamard matrices, bit-reversal placement, and R = U · P · H.

Conventions. Rows are rotated on the right: ``x' = x @ R`` for a key/value row ``x`` of ``d`` elements, and queries
use the same ``R_K`` (``q' = q @ R_K``), so ``q' · k' = q · k`` exactly because ``R`` is orthogonal.

* ``U`` (d × d): eigenvectors of a target covariance as columns, eigenvalues in descending order (optionally with
  an anchor direction first, see :func:`anchored_eigh`).
* ``P`` (d × d): the bit-reversal placement of that order, ``P[:, br(i)] = e_i``: column ``br(i)`` of ``U @ P`` is the
  eigenvector of the i-th largest eigenvalue. ``br`` is the bit reversal of ``i`` over ``ceil(log2 d)`` bits,
  pruned to values below ``d`` when ``d`` is not a power of two (keep the bit-reversed sequence of
  ``0 .. 2**ceil(log2 d) - 1`` in order, dropping entries ``>= d``).
* ``H`` (d × d): block-diagonal normalised Hadamard with blocks of the quantization group size ``g`` (one block
  when ``g = d``). Because the blocks are the quantization groups, bit reversal spreads the large eigen-directions
  evenly over the groups (0 -> 0, 1 -> d/2, 2 -> d/4, ...), and each block then spreads its share over its ``g``
  coordinates, so every group sees the same mix of large and small directions.

The product ``U @ P @ H`` is what the literature writes as ``U·H·P`` with ``P`` acting on the eigenvalue order; the
permutation must act before the mixing (a permutation after a full Hadamard only reorders coordinates inside a
group, which a per-group quantizer cannot see).

Hadamard orders. ``hadamard(n)`` builds a normalised Hadamard matrix for every ``n`` that is a power of two times an
order from the Paley constructions: Paley I gives ``q + 1`` for a prime ``q ≡ 3 (mod 4)`` (4, 8, 12, 20, 24, 32, 44,
48, ...), Paley II gives ``2 (q + 1)`` for a prime ``q ≡ 1 (mod 4)`` (12, 28, 36, 60, ...); a Kronecker product with
Sylvester's ``H_2`` doubles any of them. That covers every head dim in use (64, 80 = 4·20, 96 = 8·12, 112 = 4·28,
128, 160, 192, 256). For an order with no such construction ``hadamard`` raises; ``mixing_matrix`` then falls back
to the orthonormal DCT-II, which also spreads energy evenly, and says so in its return value.
"""

from __future__ import annotations

import math
from functools import cache

import torch


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    return all(n % p for p in range(2, math.isqrt(n) + 1))


def _paley_jacobsthal(q: int) -> torch.Tensor:
    """Jacobsthal matrix Q[i, j] = chi(j - i) over GF(q), q prime."""
    squares = {(i * i) % q for i in range(1, q)}
    chi = torch.tensor([0] + [1 if a in squares else -1 for a in range(1, q)], dtype=torch.float64)
    idx = (torch.arange(q).view(1, -1) - torch.arange(q).view(-1, 1)) % q
    return chi[idx]


def _paley_i(q: int) -> torch.Tensor:
    """Order q + 1 Hadamard matrix (unnormalised), q prime, q ≡ 3 mod 4."""
    n = q + 1
    s = torch.zeros(n, n, dtype=torch.float64)
    s[0, 1:] = 1
    s[1:, 0] = -1
    s[1:, 1:] = _paley_jacobsthal(q)
    return s + torch.eye(n, dtype=torch.float64)


def _paley_ii(q: int) -> torch.Tensor:
    """Order 2 (q + 1) Hadamard matrix (unnormalised), q prime, q ≡ 1 mod 4."""
    n = q + 1
    c = torch.zeros(n, n, dtype=torch.float64)
    c[0, 1:] = 1
    c[1:, 0] = 1
    c[1:, 1:] = _paley_jacobsthal(q)
    a = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    out = torch.zeros(2 * n, 2 * n, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            block = b if i == j else (a if c[i, j] > 0 else -a)
            out[2 * i : 2 * i + 2, 2 * j : 2 * j + 2] = block
    return out


@cache
def _base_order(m: int) -> torch.Tensor | None:
    """An unnormalised Hadamard matrix of order m from Paley I/II, or None."""
    if m == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    if m == 2:
        return torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    if _is_prime(m - 1) and (m - 1) % 4 == 3:
        return _paley_i(m - 1)
    if m % 2 == 0 and _is_prime(m // 2 - 1) and (m // 2 - 1) % 4 == 1:
        return _paley_ii(m // 2 - 1)
    return None


@cache
def _hadamard_f64(n: int) -> torch.Tensor:
    if n < 1:
        raise ValueError(f"Hadamard order must be positive, got {n}")
    # Try base orders m = n / 2**k from the largest power of two down; Sylvester-double the first that exists.
    k = 0
    while n % (2 ** (k + 1)) == 0:
        k += 1
    for j in range(k, -1, -1):
        base = _base_order(n >> j)
        if base is not None:
            h = base
            h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
            for _ in range(j):
                h = torch.kron(h2, h)
            return h / math.sqrt(n)
    raise ValueError(f"no Hadamard construction for order {n}; use a power of two times 12, 20, 28, ...")


def hadamard(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Normalised Hadamard matrix ``[n, n]`` (orthogonal, entries ±1/sqrt(n)). Raises if the order is unsupported."""
    return _hadamard_f64(n).to(dtype)


def dct_matrix(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Orthonormal DCT-II ``[n, n]`` with rows as basis vectors transposed so that ``x @ D`` transforms ``x``."""
    k = torch.arange(n, dtype=torch.float64).view(1, -1)
    i = torch.arange(n, dtype=torch.float64).view(-1, 1)
    d = torch.cos(math.pi * (i + 0.5) * k / n) * math.sqrt(2.0 / n)
    d[:, 0] = math.sqrt(1.0 / n)
    return d.to(dtype)


def mixing_matrix(d: int, group: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, str]:
    """Block-diagonal mixing ``[d, d]`` with blocks of ``group``; Hadamard where possible, else DCT-II.

    Returns the matrix and its kind (``"hadamard"`` or ``"dct"``).
    """
    if d % group:
        raise ValueError(f"group {group} must divide head dim {d}")
    try:
        block, kind = _hadamard_f64(group), "hadamard"
    except ValueError:
        block, kind = dct_matrix(group, torch.float64), "dct"
    return torch.block_diag(*[block] * (d // group)).to(dtype), kind


def bit_reversal(n: int) -> torch.Tensor:
    """``br`` as an int64 ``[n]`` permutation: ``br[i]`` is the slot of the i-th item (pruned for non powers of 2)."""
    bits = max(1, math.ceil(math.log2(n))) if n > 1 else 1
    seq = [int(format(i, f"0{bits}b")[::-1], 2) for i in range(1 << bits)]
    return torch.tensor([s for s in seq if s < n], dtype=torch.int64)


def placement(n: int) -> torch.Tensor:
    """The permutation matrix ``P`` ``[n, n]`` with ``P[:, br(i)] = e_i`` (float64)."""
    p = torch.zeros(n, n, dtype=torch.float64)
    p[torch.arange(n), bit_reversal(n)] = 1.0
    return p


def eigh_desc(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigen-decomposition of a symmetric ``[d, d]`` matrix, eigenvalues descending (float64).

    Returns ``(eigenvalues [d], U [d, d])`` with eigenvectors as columns. Signs are fixed so that the largest
    entry of every column is positive, which makes the result reproducible across LAPACK builds.
    """
    c = cov.double()
    evals, evecs = torch.linalg.eigh(0.5 * (c + c.T))
    evals, evecs = evals.flip(0), evecs.flip(1)
    idx = evecs.abs().argmax(0)
    signs = torch.sign(evecs[idx, torch.arange(evecs.shape[1])])
    signs[signs == 0] = 1
    return evals, evecs * signs


def anchored_eigh(anchor_cov: torch.Tensor, cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A basis whose first column is the leading eigenvector ``a`` of ``anchor_cov`` and whose other columns are the
    eigenvectors of ``cov`` restricted to the complement of ``a`` (descending). Returns ``(eigenvalues, U)`` float64;
    eigenvalue 0 is the Rayleigh quotient ``aᵀ cov a``.

    Why: with ``U · P · H``, column 0 of ``U`` lands on position ``br(0) = 0`` and then on the first row of ``H`` (the
    constant vector ``1/sqrt(g)``), which a per-group asymmetric quantizer absorbs in its zero point at no cost. For
    keys, the leading direction of the uncentred key second moment is their large shared offset; anchoring it there
    takes it out of every row's range, while the rest of the basis still follows the query covariance.
    """
    a = eigh_desc(anchor_cov)[1][:, :1]
    c = cov.double()
    proj = torch.eye(c.shape[0], dtype=torch.float64) - a @ a.T
    evals, evecs = eigh_desc(proj @ c @ proj)
    # the complement's null direction is a itself (eigenvalue ~0): drop the column most aligned with it
    drop = (evecs.T @ a).abs().squeeze(1).argmax()
    keep = [i for i in range(c.shape[0]) if i != drop]
    u = torch.cat([a, evecs[:, keep]], 1)
    lead = (a.T @ c @ a).view(1)
    return torch.cat([lead, evals[keep]]), u


def random_signs(d: int, seed: int) -> torch.Tensor:
    """Diagonal ``[d, d]`` of ±1 drawn from a seeded generator (float64)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, 2, (d,), generator=g).double() * 2 - 1
    return torch.diag(s)


def compose(
    cov: torch.Tensor | None,
    *,
    use_u: bool,
    use_p: bool,
    use_h: bool,
    group: int,
    signs_seed: int | None = None,
    anchor: torch.Tensor | None = None,
) -> torch.Tensor:
    """Build ``R = [S] · [U] · [P] · [H]`` (float64 ``[d, d]``); each factor is optional.

    ``cov``: float ``[d, d]`` target covariance (needed when ``use_u``). ``signs_seed`` adds the random-sign diagonal
    ``S`` in front (the data-free QuaRot-style rotation is ``S · H``). ``anchor``: a ``[d, d]`` covariance whose
    leading eigenvector becomes U's first column (see :func:`anchored_eigh`).
    """
    if use_u and cov is None:
        raise ValueError("an eigenbasis rotation needs a covariance")
    d = cov.shape[-1] if cov is not None else None
    if d is None:
        raise ValueError("pass the covariance (or an identity of the head dim) to fix the dimension")
    r = torch.eye(d, dtype=torch.float64)
    if signs_seed is not None:
        r = r @ random_signs(d, signs_seed)
    if use_u:
        r = r @ (anchored_eigh(anchor, cov)[1] if anchor is not None else eigh_desc(cov)[1])
    if use_p:
        r = r @ placement(d)
    if use_h:
        r = r @ mixing_matrix(d, group)[0]
    return r


def split_rotation(cq: torch.Tensor, ck: torch.Tensor, m: int, least: bool = False) -> torch.Tensor:
    """The rotation of split key rows (float64 ``[d, d]``): columns ``:m`` mix the ``m`` directions that carry the most
    logit signal, columns ``m:`` the others.

    A key row's logit error is ``Δkᵀ C_Q Δk``; along eigenvector ``u_i`` of C_Q (anchored on the keys' offset,
    :func:`anchored_eigh` of ``ck``, the keys' uncentred second moment) the signal is ``λ_i σ_i²``, the query energy
    times the key energy ``u_iᵀ C_K u_i``. The ``m`` directions of the largest signal form the 4-bit part, the rest the
    2-bit part with the offset first (on its Hadamard's constant row, where the zero point absorbs it); each part gets
    its own bit-reversal placement and normalised Hadamard (DCT where no Hadamard of its size exists), ordered by
    eigenvalue within it. ``least``: the control, the ``m`` directions of the *least* signal in the 4-bit part."""
    lam, u = anchored_eigh(ck, cq)
    energy = lam * torch.einsum("di,de,ei->i", u, ck.double(), u)
    energy[0] = torch.inf if least else -torch.inf  # the offset stays in the 2-bit part
    order = torch.argsort(energy, descending=not least)
    top, low = order[:m], order[m:]
    rest = low[low != 0]
    low = torch.cat([low[low == 0], rest[torch.argsort(lam[rest], descending=True)]])
    top = top[torch.argsort(lam[top], descending=True)]
    d = cq.shape[0]
    r = torch.zeros(d, d, dtype=torch.float64)
    for cols, idx in ((slice(0, m), top), (slice(m, d), low)):
        n = len(idx)
        if n:
            r[:, cols] = u[:, idx] @ placement(n) @ mixing_matrix(n, n)[0]
    return r


HADAMARD_SEED = 0
"""Seed of the random signs of the data-free Hadamard rotation (fixed so that every artifact, eval and report agree)."""


def data_free(d: int, group: int, *, use_p: bool = False, use_h: bool = True,
              random_signs: bool = True) -> torch.Tensor:
    """A rotation built without statistics, ``[S]·[P]·[H]`` (random signs seeded by :data:`HADAMARD_SEED`, H
    block-diagonal with blocks of ``group``): float64 ``[d, d]``. The defaults are the data-free baseline ``S · H``."""
    return compose(torch.eye(d, dtype=torch.float64), use_u=False, use_p=use_p, use_h=use_h, group=group,
                   signs_seed=HADAMARD_SEED if random_signs else None)


def orthogonality_error(r: torch.Tensor) -> float:
    """``max |R^T R - I|`` in float64."""
    r = r.double()
    return (r.T @ r - torch.eye(r.shape[-1], dtype=torch.float64)).abs().max().item()
