"""The SGLang backend's core on SGLang-shaped inputs, through the real kernels (TRITON_INTERPRET=1 on CPU), without
SGLang: ``req_to_token`` rows, ``req_pool_indices``, ``seq_lens``, prefix/extend lengths, ``out_cache_loc``, slots
shared through a radix-cache prefix, CUDA-graph padded decode batches; and exact prefix caching through anchors.

K/V/Q of a token are fixed random functions of (layer, token id, position), as a model's would be for a fixed
prefix, so requests sharing a prefix share its K/V exactly. The reference computes the project's attention semantics
from each sequence's un-rotated K/V history: position ``t`` reads key ``j`` exactly (rotated, bf16) when
``j < sink`` or ``j > t - recent``, through its INT2 code (the kernels' fp32 reference quantiser) otherwise."""

from __future__ import annotations

import math

import pytest
import torch
from oscar_kernels import dequantize_ref, quantize_pack_ref
from oscar_kernels.scheme import DecodeOptions, QuantScheme

from oscar_cli.serve.sglang.anchors import PIN_STEPS, AnchorTable, anchor_positions, anchored_positions
from oscar_cli.serve.sglang.core import OscarAttention, OscarKV

HKV, HQ, D = 2, 4, 16
SINK, RECENT = 4, 8
VOCAB, MAX_POS, SLOTS, REQS = 64, 96, 512, 6
TOL = dict(atol=8e-3, rtol=8e-3)
"""Outputs are bf16 (the query dtype): one bf16 ulp around the fp32 reference."""


def rotations(n: int, gen: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(n, D, D, generator=gen, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)).float()


class Model:
    """Per-layer K/V/Q tables indexed by (token id, position) and the artifact's rotations and clips."""

    def __init__(self, seed: int = 0, per_head: bool = True, layers: int = 1, fp8: bool = False,
                 widths: tuple[tuple[int, int], ...] = ()):
        g = torch.Generator().manual_seed(seed)
        self.layers = L = layers
        self.widths = widths or ((2, 2),) * L  # (K, V) code widths per layer: an allocated scheme's
        # FP8 scales: per-layer, per-KV-head multipliers of two binades (None: fp16 scales)
        self.mult = torch.exp2(-torch.randint(4, 6, (2, L, HKV), generator=g).float()) if fp8 else None
        h = HKV if per_head else 1
        self.rot_k = torch.stack([rotations(h, g) for _ in range(L)])
        self.rot_v = torch.stack([rotations(h, g) for _ in range(L)])
        self.clip_k = 0.7 + 0.3 * torch.rand(L, h, generator=g)
        self.clip_v = 0.7 + 0.3 * torch.rand(L, h, generator=g)
        self.k_tok = torch.randn(L, VOCAB, HKV, D, generator=g)
        self.v_tok = torch.randn(L, VOCAB, HKV, D, generator=g)
        self.q_tok = torch.randn(L, VOCAB, HQ, D, generator=g)
        self.pos = torch.randn(L, MAX_POS, 1, D, generator=g) * 0.5
        self.k_bias = torch.randn(L, 1, HKV, D, generator=g) * 2  # a shared key offset, as real keys have

    def kqv(self, layer: int, tokens: list[int], positions: list[int]):
        t, p = torch.tensor(tokens), torch.tensor(positions)
        k = (self.k_tok[layer, t] + self.pos[layer, p] + self.k_bias[layer]).to(torch.bfloat16)
        v = (self.v_tok[layer, t] + self.pos[layer, p]).to(torch.bfloat16)
        q = (self.q_tok[layer, t] + self.pos[layer, p]).to(torch.bfloat16)
        return q, k, v

    def kv(self, anchors: int = 8, interval: int = 16, finish_anchors: bool = False) -> OscarKV:
        fp8 = self.mult is not None
        scheme = QuantScheme(sink=SINK, recent=RECENT, scale_dtype="fp8" if fp8 else "fp16",
                             bits_k=tuple(w[0] for w in self.widths), bits_v=tuple(w[1] for w in self.widths))
        return OscarKV(scheme, self.layers, HKV, D, SLOTS, REQS, self.rot_k, self.rot_v, self.clip_k, self.clip_v, anchors, interval, "cpu",
                       finish_anchors=finish_anchors, mult_k=self.mult[0] if fp8 else None,
                       mult_v=self.mult[1] if fp8 else None)


def reference(model: Model, layer: int, tokens: list[int], c0: int, c1: int, recent: int = RECENT) -> torch.Tensor:
    """fp32 ``[c1 - c0, Hq, d]``: attention of positions ``[c0, c1)`` of ``tokens`` over positions ``<= t``."""
    pos = list(range(c1))
    q, k, v = model.kqv(layer, tokens[:c1], pos)
    rk = model.rot_k[layer].expand(HKV, D, D)
    rv = model.rot_v[layer].expand(HKV, D, D)

    def rows(x, rot, clip, mult, bits):
        exact = torch.einsum("nhd,hde->nhe", x.float(), rot).to(torch.bfloat16).float()
        codes = torch.empty(c1, HKV, D // 4, dtype=torch.uint8)
        hi = torch.empty_like(codes) if bits == 4 else None
        scale = torch.empty(c1, HKV, 1, dtype=torch.float16 if mult is None else torch.float8_e4m3fn)
        zero = torch.empty_like(scale)
        quantize_pack_ref(x, rot, clip.expand(HKV).contiguous(), codes, scale, zero, torch.arange(c1), D, mult=mult,
                          codes_hi=hi)
        return exact, dequantize_ref(codes, scale, zero, D, mult, hi)

    mk, mv = (None, None) if model.mult is None else (model.mult[0, layer], model.mult[1, layer])
    ek, ik = rows(k, rk, model.clip_k[layer], mk, model.widths[layer][0])
    ev, iv = rows(v, rv, model.clip_v[layer], mv, model.widths[layer][1])
    out = torch.empty(c1 - c0, HQ, D)
    j = torch.arange(c1)
    for i, t in enumerate(range(c0, c1)):
        exact = (j < SINK) | (j > t - recent)
        use = j <= t
        kk = torch.where(exact[:, None, None], ek, ik)[use]
        vv = torch.where(exact[:, None, None], ev, iv)[use]
        for h in range(HQ):
            kh = h // (HQ // HKV)
            s = (kk[:, kh] @ (q[t, h].float() @ rk[kh])) / math.sqrt(D)
            out[i, h] = (torch.softmax(s, 0) @ vv[:, kh]) @ rv[kh].T
    return out


class Sim:
    """SGLang's side of a batch: a slot allocator, ``req_to_token``, and the calls SGLang's backend would make."""

    def __init__(self, model: Model, kv: OscarKV, max_tokens: int = 128):
        self.model, self.kv = model, kv
        self.req_to_token = torch.zeros(REQS, MAX_POS, dtype=torch.int32)
        self.free = list(range(SLOTS - 1, 0, -1))  # slot 0 pads
        self.core = OscarAttention(kv, self.req_to_token, max_batch=REQS, max_tokens=max_tokens, q_heads=HQ)

    def alloc(self, n: int) -> list[int]:
        return [self.free.pop() for _ in range(n)]

    def extend(self, seqs: list[tuple[str, int, list[int], int, int]], prefix_slots: dict | None = None):
        """``seqs``: (request id, req_pool_idx, tokens, c0, c1). ``prefix_slots[rid]``: slots of positions < c0
        shared from the radix cache (written into ``req_to_token`` as SGLang does). Returns per-seq outputs."""
        locs = []
        for rid, r, _, c0, c1 in seqs:
            if prefix_slots and rid in prefix_slots:
                self.req_to_token[r, :c0] = torch.tensor(prefix_slots[rid], dtype=torch.int32)
            new = self.alloc(c1 - c0)
            self.req_to_token[r, c0:c1] = torch.tensor(new, dtype=torch.int32)
            locs += new
        loc = torch.tensor(locs, dtype=torch.int64)
        self.core.plan_extend(torch.tensor([s[1] for s in seqs]), torch.tensor([s[3] for s in seqs], dtype=torch.int32),
                              torch.tensor([s[4] - s[3] for s in seqs], dtype=torch.int32), loc,
                              [s[3] for s in seqs], [s[4] - s[3] for s in seqs], [s[0] for s in seqs])
        outs = []
        for layer in range(self.model.layers):
            parts = [self.model.kqv(layer, toks[c0:c1], list(range(c0, c1))) for _, _, toks, c0, c1 in seqs]
            q, k, v = (torch.cat([p[i] for p in parts]) for i in range(3))
            outs.append(self.core.forward_extend(layer, q, k, v).float())
        return self._split(outs, [s[4] - s[3] for s in seqs])

    def decode(self, seqs: list[tuple[int, list[int], int]], pad_to: int | None = None):
        """``seqs``: (req_pool_idx, tokens, n) with the new token at position ``n - 1``. ``pad_to``: a CUDA-graph
        padded batch (rows of request 0, length 1; ``out_cache_loc`` only for the live rows)."""
        new = self.alloc(len(seqs))
        for (r, _, n), s in zip(seqs, new, strict=True):
            self.req_to_token[r, n - 1] = s
        pad = (pad_to or len(seqs)) - len(seqs)
        rpi = torch.tensor([s[0] for s in seqs] + [0] * pad)
        lens = torch.tensor([s[2] for s in seqs] + [1] * pad, dtype=torch.int32)
        self.core.plan_decode(rpi, lens, torch.tensor(new))
        outs = []
        for layer in range(self.model.layers):
            parts = [self.model.kqv(layer, [toks[n - 1]], [n - 1]) for _, toks, n in seqs]
            parts += [self.model.kqv(layer, [0], [0])] * pad
            q, k, v = (torch.cat([p[i] for p in parts]) for i in range(3))
            outs.append(self.core.forward_decode(layer, q, k, v).float()[:len(seqs)])
        return self._split(outs, [1] * len(seqs))

    @staticmethod
    def _split(outs, lens):
        res, start = [], 0
        for n in lens:
            res.append([o[start:start + n] for o in outs])
            start += n
        return res


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check(model, got_layers, toks, c0, c1):
    for layer, got in enumerate(got_layers):
        torch.testing.assert_close(got, reference(model, layer, toks, c0, c1), **TOL)


# ------------------------------------------------------------------------------------------------------ (b) kernels
@pytest.mark.parametrize("variant", ["fp16", "fp8", "mixed-widths"])
def test_extend_and_padded_decode_match_reference_over_shared_prefix_slots(variant):
    """Two layers; two requests in one extend batch (ragged lengths, one with a radix-cache prefix computed by a third
    request earlier), then decode steps in a CUDA-graph padded batch: every output matches the reference, and
    planning again for the next step keeps the plan's buffers (what a captured graph replays on). Also with FP8
    scales (an artifact's per-head multipliers through the pool) and with an allocation (4-bit keys in layer 0,
    4-bit values in layer 1)."""
    widths = ((4, 2), (2, 4)) if variant == "mixed-widths" else ()
    model = Model(seed=1, layers=2, fp8=variant == "fp8", widths=widths)
    kv = model.kv(anchors=8, interval=0)
    sim = Sim(model, kv)
    a = tokens(30, 1)
    sim.extend([("A", 1, a, 0, 30)])  # anchors at 30 (chunk end)
    b = a[:30] + tokens(9, 2)
    c = tokens(21, 3)
    (ob, oc) = sim.extend([("B", 2, b, 30, 39), ("C", 3, c, 0, 21)], prefix_slots={"B": sim.req_to_token[1, :30].tolist()})
    check(model, ob, b, 30, 39)
    check(model, oc, c, 0, 21)
    assert int(sim.core.restore_misses) == 0
    wrong = reference(model, 0, b, 30, 39, recent=RECENT - 1)  # the check can tell a window off by one
    assert (ob[0] - wrong).abs().max() > 5 * TOL["atol"]
    ptrs = set()
    for step in range(2):
        b.append(tokens(1, 10 + step)[0])
        c.append(tokens(1, 20 + step)[0])
        ob, oc = sim.decode([(2, b, len(b)), (3, c, len(c))], pad_to=4)
        check(model, ob, b, len(b) - 1, len(b))
        check(model, oc, c, len(c) - 1, len(c))
        idx = sim.core.decode.index
        ptrs.add((idx.kv_indices.data_ptr(), idx.bf16_indices.data_ptr(), idx.num_splits.data_ptr()))
    assert len(ptrs) == 1


def test_decode_options_reach_the_decode_plan():
    """``OscarSettings.decode`` (through the plugin's ``OscarAttention``) is the decode plan's ``options``, unchanged;
    the defaults when none are given."""
    model = Model(seed=1, layers=1)
    kv = model.kv(anchors=8, interval=0)
    req_to_token = torch.zeros(REQS, MAX_POS, dtype=torch.int32)
    plain = OscarAttention(kv, req_to_token, max_batch=REQS, max_tokens=64, q_heads=HQ)
    assert plain.decode.options == DecodeOptions()
    options = DecodeOptions(int8_scores=True, int8_values=True, lean_tiles=True, fused_update=True, split_tokens=64)
    tuned = OscarAttention(kv, req_to_token, max_batch=REQS, max_tokens=64, q_heads=HQ, options=options)
    assert tuned.decode.options == options


def test_chunked_extend_equals_one_extend_without_anchors():
    """A chunked-prefill continuation is not a first extend: with no anchor store at all the second chunk still reads
    the request's own region (and equals one extend of the whole prompt)."""
    model = Model(seed=3)
    sim = Sim(model, model.kv(anchors=0))
    a = tokens(37, 6)
    (o1,) = sim.extend([("A", 1, a, 0, 20)])
    (o2,) = sim.extend([("A", 1, a, 20, 37)])
    check(model, o1, a, 0, 20)
    check(model, o2, a, 20, 37)


# ------------------------------------------------------------------------------------------------------ (c) anchors
def test_anchor_positions_and_rows():
    assert anchor_positions(0, 40, 16) == [16, 32, 40]
    assert anchor_positions(16, 33, 16) == [32, 33]
    assert anchor_positions(5, 5, 16) == []
    assert anchor_positions(0, 40, 0) == [40]
    assert anchored_positions(3, 4, 8) == [0, 1, 2]
    assert anchored_positions(30, 4, 8) == [0, 1, 2, 3, *range(22, 30)]


def reuse_vs_fresh(model, seed_b, shared, extra, a_len, interval, expect):
    """Request A computes ``a_len`` tokens; B shares ``shared`` of them, then ``extra`` of its own. B matches through
    the anchors (capped match), restores, extends, decodes once; the same B computed from scratch in a fresh pool
    gives the same outputs. Returns the reused length."""
    kv = model.kv(anchors=8, interval=interval)
    sim = Sim(model, kv)
    a = tokens(a_len, 100)
    sim.extend([("A", 1, a, 0, a_len)])
    b = a[:shared] + tokens(extra, seed_b)
    matched = sim.req_to_token[1, :shared].long()  # what the radix tree returns for B's prompt
    reuse, entry = kv.table.deepest(matched)
    assert reuse == expect and (entry >= 0) == (reuse > 0)
    kv.table.pin("B", entry)
    (ob,) = sim.extend([("B", 4, b, reuse, len(b))], prefix_slots={"B": sim.req_to_token[1, :reuse].tolist()})
    assert int(sim.core.restore_misses) == 0
    fresh = Sim(model, model.kv(anchors=8, interval=interval))
    (of,) = fresh.extend([("B", 4, b, 0, len(b))])
    for got, want in zip(ob, of, strict=True):
        torch.testing.assert_close(got, want[reuse:], atol=1e-4, rtol=1e-4)
    b.append(tokens(1, 200)[0])
    (db,) = sim.decode([(4, b, len(b))])
    (df,) = fresh.decode([(4, b, len(b))])
    for got, want in zip(db, df, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    check(model, ob, b, reuse, len(b) - 1)
    return reuse


def test_reuse_at_the_chunk_end_anchor_is_exact():
    """A warmed prefix (sent alone first): B's match is the whole of A's prompt, anchored at A's chunk end."""
    assert reuse_vs_fresh(Model(seed=4), 7, shared=40, extra=6, a_len=40, interval=0, expect=40) == 40


def test_match_is_capped_to_the_deepest_anchor_before_divergence():
    """B diverges inside A's prompt (after 37 tokens): the match is capped to A's interval anchor at 32, and reusing
    32 tokens (rows before A's chunk end, taken from inside the chunk) is exact."""
    assert reuse_vs_fresh(Model(seed=5), 8, shared=37, extra=5, a_len=44, interval=16, expect=32) == 32


def test_deepest_anchor_of_a_match():
    """The cap is the deepest anchored position not beyond the match: anchors of A at 16, 32 and 44."""
    model = Model(seed=5)
    kv = model.kv(anchors=8, interval=16)
    sim = Sim(model, kv)
    sim.extend([("A", 1, tokens(44, 100), 0, 44)])
    slots = sim.req_to_token[1, :44].long()
    got = {m: kv.table.deepest(slots[:m])[0] for m in (0, 15, 16, 31, 32, 43, 44)}
    assert got == {0: 0, 15: 0, 16: 16, 31: 16, 32: 32, 43: 32, 44: 44}


def test_finish_anchor_gives_multi_turn_reuse():
    """A finishes after its prompt and two decode steps; its snapshot at the end (position 32) lets the next turn
    reuse everything, exactly."""
    model = Model(seed=7)
    kv = model.kv(anchors=8, interval=0, finish_anchors=True)
    sim = Sim(model, kv)
    a = tokens(30, 11)
    sim.extend([("A", 1, a, 0, 30)])
    for step in range(2):
        a.append(tokens(1, 50 + step)[0])
        sim.decode([(1, a, len(a))])
    assert kv.table.deepest(sim.req_to_token[1, :32].long())[0] == 30  # only the prompt-end anchor so far
    kv.snapshot(1, 32, sim.req_to_token[1, 31:32].long())
    kv.finished("A")
    reuse, entry = kv.table.deepest(sim.req_to_token[1, :32].long())
    assert reuse == 32
    b = a + tokens(7, 12)
    (ob,) = sim.extend([("B", 1, b, 32, len(b))], prefix_slots={"B": sim.req_to_token[1, :32].tolist()})
    check(model, ob, b, 32, len(b))
    fresh = Sim(model, model.kv())
    (of,) = fresh.extend([("B", 1, b, 0, len(b))])
    for got, want in zip(ob, of, strict=True):
        torch.testing.assert_close(got, want[32:], atol=1e-4, rtol=1e-4)


def test_rewritten_slot_never_serves_a_stale_anchor():
    """A's anchor at 20 is keyed by the slot of position 19. Once that slot is freed and written by another request,
    a lookup over A's old slots finds no anchor there; an entry reused by the FIFO unbinds its old key too."""
    model = Model(seed=8)
    kv = model.kv(anchors=2, interval=0)
    sim = Sim(model, kv)
    a = tokens(20, 13)
    sim.extend([("A", 1, a, 0, 20)])
    old = sim.req_to_token[1, :20].long().clone()
    assert kv.table.deepest(old)[0] == 20
    sim.free.append(int(old[19]))  # the radix cache evicts A's last slot; the allocator hands it out next
    sim.extend([("C", 2, tokens(5, 14), 0, 5)])
    assert int(sim.req_to_token[2, 0]) == int(old[19])
    assert kv.table.deepest(old) == (0, -1)
    # FIFO reuse: with 2 entries, two more extends take A2's entry back; its key no longer resolves
    sim.extend([("A2", 3, a, 0, 12)])
    key2 = sim.req_to_token[3, :12].long().clone()
    assert kv.table.deepest(key2)[0] == 12
    sim.extend([("D", 4, tokens(4, 15), 0, 4)])
    sim.extend([("E", 5, tokens(4, 16), 0, 4)])
    assert kv.table.deepest(key2) == (0, -1)


def test_pinned_anchor_survives_eviction_pressure():
    """A match pins its anchor: however many anchors are taken afterwards, the entry is neither reused nor unbound
    until the pin goes; then the FIFO takes it."""
    t = AnchorTable(num_slots=64, capacity=3)
    t.bind(torch.tensor([0]), torch.tensor([10]))
    e = int(t.entries_at(torch.tensor([10]))[0])
    t.pin("B", e)
    got = [t.allocate() for _ in range(9)]
    assert e not in got and set(got) == {1, 2}
    for i, x in enumerate(got):
        t.bind(torch.tensor([x]), torch.tensor([20 + i]))
    assert t.deepest(torch.tensor([3, 10]).long()) == (2, e)
    t.pin("B2", e)
    t.unpin("B")
    assert t.pinned(e)
    t.unpin("B2")
    assert e in [t.allocate() for _ in range(3)]


def test_a_pin_that_is_not_renewed_expires_after_a_fixed_number_of_batches():
    """A request matched but never scheduled (aborted while waiting) does not hold its entry forever; expiry counts
    planned batches, the same on every TP rank (never garbage collection)."""
    t = AnchorTable(num_slots=8, capacity=2)
    t.pin("waiting", 1)
    for _ in range(PIN_STEPS):
        t.mark()
    assert t.pinned(1)
    t.pin("renewed", 0)
    t.mark()
    assert not t.pinned(1) and t.pinned(0)


def test_all_pinned_means_no_new_anchor_and_no_overwrite():
    model = Model(seed=9)
    kv = model.kv(anchors=1, interval=0)
    sim = Sim(model, kv)
    a = tokens(16, 17)
    sim.extend([("A", 1, a, 0, 16)])
    key = sim.req_to_token[1, :16].long().clone()
    a_len, e = kv.table.deepest(key)
    kv.table.pin("B", e)
    sim.extend([("C", 2, tokens(10, 18), 0, 10)])  # wants an anchor, finds the only entry pinned
    assert kv.table.deepest(key) == (16, e)
    assert kv.table.deepest(sim.req_to_token[2, :10].long()) == (0, -1)


@pytest.mark.parametrize("per_head", [True, False])
def test_shared_and_per_head_rotations(per_head):
    """Shared (h = 1) and per-head artifacts run the same path."""
    model = Model(seed=10, per_head=per_head)
    sim = Sim(model, model.kv())
    a = tokens(18, 19)
    (oa,) = sim.extend([("A", 1, a, 0, 18)])
    check(model, oa, a, 0, 18)
