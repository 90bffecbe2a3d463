"""Calibration pass: model hooks -> streaming float64 statistics -> the store.

The hook is a registered transformers attention function (``AttentionInterface``), so it sees exactly the post-RoPE
queries and keys and the values that attention uses, for any architecture that routes attention through that
interface, with no forked model code. It computes attention with SDPA (causal, GQA) and records, per layer and per
KV head ``h`` (its GQA group of query heads pooled), over positions ``t >= skip``:

* ``q``: C_Q = Σ q qᵀ / N over the query heads that read KV head ``h``;
* ``k``, ``v``: C_K = Σ k kᵀ / N, C_V = Σ v vᵀ / N (raw second moments, for ablations);
* ``s``: the score-weighted value target C_S = Σ_t w_t v_t v_tᵀ / Σ_t w_t with w_t = k_t Ĉ_Q k_tᵀ (normalised to mean 1
  by the division). Ĉ_Q is the running C_Q of head ``h`` including the current batch: a streaming pass cannot know
  the final C_Q, and the running estimate after a few thousand rows differs from it by sampling noise only. It is
  deterministic given the batches, so resumed and uninterrupted runs agree exactly;
* ``o``: the attention-output covariance C_O = Σ o oᵀ / N, o = (softmax(q kᵀ) V) per query head, pooled per KV head.

Each accumulator keeps ``(count, weight, Σ outer products)`` in float64. A bounded reservoir keeps the post-RoPE q, k
and v rows of ``reservoir`` tokens: every token gets a priority from a generator seeded by (seed, batch index), and the
tokens with the smallest priorities are kept (bottom-k sampling), so the sample is the same whether a run is
resumed or not, and the same tokens are kept in every layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .config import CHECKPOINT_BYTES, CollectConfig
from .models import LoadedModel, attention_modules, attention_shape
from .stats import StatsAccumulator

ATTN_NAME = "oscar_collect"
CAPTURE_ATTR = "_oscar_capture"
"""Attribute under which :func:`capturing` hands the active capture to each attention module (removed afterwards)."""


@dataclass
class _Capture:
    acc: StatsAccumulator
    keep: torch.Tensor | None = None  # bool [B, T]: tokens entering the reservoir this batch
    rows: dict | None = None  # {(layer, kind): tensor [n, width]}


def _collect_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention function registered as ``oscar_collect``: SDPA plus statistics for the active capture."""
    out = F.scaled_dot_product_attention(
        query, key, value, is_causal=query.shape[2] > 1, scale=scaling, enable_gqa=True
    )
    cap = getattr(module, CAPTURE_ATTR, None)
    if cap is not None:
        layer = module.layer_idx
        cap.acc.update(layer, query, key, value, out)
        if cap.keep is not None and cap.keep.any():
            for kind, t in (("q", query), ("k", key), ("v", value)):
                rows = t.permute(0, 2, 1, 3)[cap.keep]  # [n, heads, d]
                cap.rows[(layer, kind)] = rows.reshape(rows.shape[0], -1).float()
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _collect_attention)


@contextlib.contextmanager
def capturing(model, cap: _Capture):
    """Route the model's attention through the collector while the block runs: the capture is handed to every
    attention module (``CAPTURE_ATTR``) and taken back afterwards, so no module-level state is involved."""
    register_attention()
    mods = attention_modules(model).values()
    old = model.config._attn_implementation
    model.config._attn_implementation = ATTN_NAME
    for m in mods:
        setattr(m, CAPTURE_ATTR, cap)
    try:
        yield
    finally:
        for m in mods:
            m.__dict__.pop(CAPTURE_ATTR, None)
        model.config._attn_implementation = old


class Reservoir:
    """Bottom-k sampling state: priorities of the tokens currently kept."""

    def __init__(self, size: int, seed: int):
        self.size = size
        self.seed = seed
        self.priorities = np.empty(0, dtype=np.float64)

    def batch_priorities(self, batch_idx: int, shape: tuple[int, int]) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + batch_idx)
        return torch.rand(shape, generator=g, dtype=torch.float64)

    def admit(self, pri: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, float]:
        """-> (bool mask of tokens that enter, new eviction threshold). ``pri``/``valid``: ``[B, T]``."""
        cand = np.concatenate([self.priorities, pri[valid].numpy()])
        if len(cand) > self.size:
            threshold = float(np.partition(cand, self.size - 1)[self.size - 1])
        else:
            threshold = float(cand.max()) if len(cand) else 1.0
        keep = valid & (pri <= threshold)
        self.priorities = np.sort(cand[cand <= threshold])
        return keep, threshold


def run_batches(
    loaded: LoadedModel,
    segments: torch.Tensor,
    cfg: CollectConfig,
    acc: StatsAccumulator,
    reservoir: Reservoir,
    start_batch: int,
    on_batch: Callable[[int, int, dict, float], None],
    device: str = "cpu",
) -> None:
    """Run batches ``start_batch..`` through the model; ``on_batch(batch_idx, tokens_in_batch, samples, threshold)``
    is called after each batch's statistics are in ``acc`` (the caller persists them)."""
    model = loaded.model
    B, T = cfg.batch_size, cfg.seq_len
    n_batches = -(-segments.shape[0] // B)
    pos = torch.arange(T)
    for b in range(start_batch, n_batches):
        ids = segments[b * B : (b + 1) * B]
        pri = reservoir.batch_priorities(b, tuple(ids.shape))
        valid = (pos >= cfg.skip).expand(ids.shape[0], T)
        keep, threshold = reservoir.admit(pri, valid)
        cap = _Capture(acc=acc, keep=keep.to(device), rows={})
        with torch.inference_mode(), capturing(model, cap):
            model(input_ids=ids.to(device), use_cache=False)
        token_ids = (torch.arange(b * B, b * B + ids.shape[0])[:, None] * T + pos[None, :])[keep].numpy()
        samples = {
            key: (token_ids, pri[keep].numpy(), rows.cpu().numpy()) for key, rows in cap.rows.items()
        }
        on_batch(b, ids.numel(), samples, threshold)



def prepare_segments(loaded: LoadedModel, cfg: CollectConfig) -> torch.Tensor:
    """The calibration token segments ``[ceil(tokens / seq_len), seq_len]`` (raises DataError on bad data)."""
    from . import data as data_mod

    if cfg.skip >= cfg.seq_len:
        raise data_mod.DataError(f"--seq-len {cfg.seq_len} must exceed the {cfg.skip} skipped sink positions")
    docs = data_mod.load_documents(cfg.data)
    return data_mod.token_segments(loaded.tokenizer, docs, cfg.seq_len, cfg.num_sequences)


def resumable_run(store, loaded: LoadedModel, cfg: CollectConfig, segments: torch.Tensor):
    """The newest unfinished run with this model, data and batching; raises if there is none."""
    from . import data as data_mod
    from .store import StoreError

    run = store.find_resumable(loaded.fingerprint, data_mod.digest(segments), cfg.seq_len, cfg.batch_size)
    if run is None:
        raise StoreError("nothing to resume: no unfinished run with this model, data, --seq-len and "
                         "--batch-size; drop --resume to start a new run")
    return run


def calibrate(loaded: LoadedModel, cfg: CollectConfig, store, *, resume: bool = False,
              progress: Callable[[int, int], None] | None = None, device: str = "cpu",
              segments: torch.Tensor | None = None) -> int:
    """Collect statistics for ``loaded`` into ``store``; returns the run id.

    ``progress(tokens_done, tokens_total)`` is called after every persisted batch. With ``resume`` the newest
    unfinished run with the same model, data and batching continues from its last persisted batch.
    """
    from . import data as data_mod

    shape = attention_shape(loaded.config)
    if segments is None:
        segments = prepare_segments(loaded, cfg)
    n_batches = -(-segments.shape[0] // cfg.batch_size)
    acc = StatsAccumulator(shape, skip=cfg.skip)
    reservoir = Reservoir(cfg.reservoir, cfg.seed)
    if resume:
        run = resumable_run(store, loaded, cfg, segments)
        store.claim_run(run)
        run_id, start = run.run_id, run.batches_done
        if start:
            acc.load_rows(store.load_stats(run_id))
            kept = store.load_samples(run_id, layer=0).get((0, "k"))
            if kept is not None:
                reservoir.priorities = np.sort(kept[1])
    else:
        run_id = store.create_run(
            model_slug=loaded.slug, model_fingerprint=loaded.fingerprint, data_spec=cfg.data,
            data_digest=data_mod.digest(segments), tokens=int(segments.numel()), seq_len=cfg.seq_len,
            batch_size=cfg.batch_size, num_batches=n_batches, config=dataclasses.asdict(cfg),
            shape=dataclasses.asdict(shape),
        )
        start = 0
    total = int(segments.numel())
    done = [start * cfg.batch_size * cfg.seq_len]
    every = cfg.checkpoint_every or max(1, -(-acc.nbytes // CHECKPOINT_BYTES))
    pending: dict = {}  # reservoir rows admitted since the last checkpoint

    def persist(b: int, n_tokens: int, samples: dict, threshold: float) -> None:
        done[0] += n_tokens
        for key, (tok, pri, rows) in samples.items():
            if key in pending:
                t0, p0, r0 = pending[key]
                tok, pri, rows = np.concatenate([t0, tok]), np.concatenate([p0, pri]), np.concatenate([r0, rows])
            pending[key] = (tok, pri, rows)
        if (b + 1 - start) % every == 0 or b + 1 == n_batches:
            # rows admitted since the last checkpoint and evicted by a later batch are not written: once the
            # reservoir is full its threshold only falls, so `priority <= threshold` is exactly what it keeps
            kept = {k: (t[p <= threshold], p[p <= threshold], r[p <= threshold]) for k, (t, p, r) in pending.items()}
            store.save_batch(run_id, b + 1, done[0], acc.as_rows(), kept, threshold)
            pending.clear()
        if progress is not None:
            progress(done[0], total)

    if progress is not None:
        progress(done[0], total)
    try:
        run_batches(loaded, segments, cfg, acc, reservoir, start, persist, device=device)
    except BaseException:
        with contextlib.suppress(Exception):
            store.set_status(run_id, "interrupted")
        raise
    store.set_status(run_id, "complete")
    return run_id
