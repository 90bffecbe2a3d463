"""Random INT2 + BF16 slot caches for the kernel tests (fresh random data, scattered slots, poisoned free slots)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from oscar_kernels import Int2Pool, quantize_pack_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"


def random_rotation(n_rot: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """fp32 ``[n_rot, d, d]`` random orthogonal matrices."""
    a = torch.randn(n_rot, d, d, generator=gen, dtype=torch.float64)
    qm, r = torch.linalg.qr(a)
    return (qm * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)).float().to(DEVICE)


def ragged(lens: list[int], pool_slots: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """indptr int32 [B+1] and shuffled distinct slot indices int32 [sum(lens)] from 1..pool_slots-1 (slot 0 stays free)."""
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    perm = torch.randperm(pool_slots - 1, generator=gen)[: sum(lens)] + 1
    return indptr.to(DEVICE), perm.to(torch.int32).to(DEVICE)


@dataclass
class Int2Cache:
    rot_k: torch.Tensor
    rot_v: torch.Tensor
    k_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    k_bf16: torch.Tensor
    v_bf16: torch.Tensor
    bf16_indptr: torch.Tensor
    bf16_indices: torch.Tensor
    group_size: int

    def args(self) -> tuple:
        """Positional arguments shared by decode_int2/extend_int2 (after the query-side ones)."""
        return (self.rot_k, self.rot_v, self.k_codes, self.k_scale, self.k_zero, self.v_codes, self.v_scale,
                self.v_zero, self.kv_indptr, self.kv_indices, self.k_bf16, self.v_bf16, self.bf16_indptr,
                self.bf16_indices)


def make_cache(int2_lens: list[int], bf16_lens: list[int], hkv: int, d: int, g: int, gen: torch.Generator,
               shared_rot: bool = False, clip_k: float = 0.9, clip_v: float = 1.0, head_major: bool = True) -> Int2Cache:
    """Quantise random K/V (with a few outlier channels) into scattered slots; free slots hold NaN scales/values.

    INT2 pools are head-major (``Int2Pool``'s layout: [S, Hkv, ...] views of [Hkv, S, ...] storage) unless
    ``head_major=False`` (plain contiguous [S, Hkv, ...]).
    """
    n_rot = 1 if shared_rot else hkv
    rot_k, rot_v = random_rotation(n_rot, d, gen), random_rotation(n_rot, d, gen)
    nnz, nnz_b = sum(int2_lens), sum(bf16_lens)
    slots, slots_b = nnz + 7, nnz_b + 5
    kv_indptr, kv_indices = ragged(int2_lens, slots, gen)
    bf16_indptr, bf16_indices = ragged(bf16_lens, slots_b, gen)
    outlier = 1.0 + 4.0 * (torch.rand(d, generator=gen) > 0.9).float()
    pools = []
    for rot, clip in ((rot_k, clip_k), (rot_v, clip_v)):
        x = (torch.randn(nnz, hkv, d, generator=gen) * outlier).to(DEVICE)
        pool = Int2Pool.empty(slots, hkv, d, g, device=DEVICE) if head_major else Int2Pool(
            torch.empty(slots, hkv, d // 4, dtype=torch.uint8, device=DEVICE),
            torch.empty(slots, hkv, d // g, dtype=torch.float16, device=DEVICE),
            torch.empty(slots, hkv, d // g, dtype=torch.float16, device=DEVICE), g)
        codes, scale, zero = pool.codes, pool.scale, pool.zero
        codes.copy_(torch.randint(0, 256, (slots, hkv, d // 4), generator=gen, dtype=torch.uint8))
        scale.fill_(float("nan"))
        zero.fill_(float("nan"))
        quantize_pack_ref(x, rot, clip, codes, scale, zero, kv_indices, g)
        pools += [codes, scale, zero]
    k_bf16 = torch.full((slots_b, hkv, d), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    v_bf16 = torch.full_like(k_bf16, float("nan"))
    k_bf16[bf16_indices.long()] = (torch.randn(nnz_b, hkv, d, generator=gen) * outlier).to(DEVICE, torch.bfloat16)
    v_bf16[bf16_indices.long()] = torch.randn(nnz_b, hkv, d, generator=gen).to(DEVICE, torch.bfloat16)
    return Int2Cache(rot_k, rot_v, *pools, kv_indptr, kv_indices, k_bf16, v_bf16, bf16_indptr, bf16_indices, g)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()
