"""SGLang plugin: OSCAR's INT2 KV cache as an attention backend of unmodified SGLang 0.5.17.

Why 0.5.17: it pins ``torch==2.11.0``, the GPU image's torch (later releases pin 2.13 / 2.14.1), and its
``sglang.srt.plugins`` mechanism covers everything below without a fork.

**Loading.** Entry point ``[sglang.srt.plugins] oscar = oscar_cli.serve.sglang:register``. SGLang calls
``load_plugins()`` in the launcher and again in every scheduler process (one per TP rank); ``SGLANG_PLUGINS=oscar``
whitelists it (``oscar serve --engine sglang`` sets it). With ``SGLANG_PLUGINS`` unset SGLang loads *every*
discovered plugin, so :func:`register` is harmless unless ``--attention-backend oscar`` is chosen: it adds the name
``oscar`` to the attention-backend choices and to the attention and radix-cache registries (factories SGLang only
calls when the name is selected), and registers four hooks that pass straight through unless the server arguments
they see select ``oscar`` (the hooked modules are imported when SGLang applies hooks, as for any hooking plugin).
SGLang only logs hook failures, so the plugin checks its targets itself (:mod:`.targets`, also tested against the
0.5.17 wheel's source) and the backend refuses to start when its pool is missing.

**The one channel.** The artifact (and the anchor settings) travel as one entry of SGLang's own
``--json-model-override-args`` (``{"oscar": {"artifact": ..., "anchors": ..., "anchor_interval": ...}}``,
:mod:`.settings`). It is a real ``ServerArgs`` field: SGLang pickles it into every scheduler/TP process, prints it in
its start line, and takes it from ``launch_server``, ``sglang serve``, ``--config`` files and ``sglang.Engine``
alike. A plugin-added server argument would need hooks on ``ServerArgs.add_cli_args`` and ``from_cli_args`` in the
launcher and extra instance attributes to survive pickling (and does not exist for ``Engine(**kwargs)``); an
environment variable is invisible in SGLang's logged arguments and is configuration outside the command line. The
quant scheme (sink, recent, group, levels) is the artifact's: there is no second source of it.

**The pool** (:mod:`.core`, :class:`oscar_kernels.Int2KVPool`). 0.5.17 picks the token-to-KV pool class in
``KVCacheConfigurator._build_mha_kv_pool``; the only official alternative is an out-of-tree *platform* (replacing
the CUDA platform). So three AROUND hooks:

* ``DefaultPoolConfigurator._compute_cell_size`` returns the rank's INT2 bytes per token slot (``Int2KVPool.
  cell_bytes``: 72 B per head and layer at d = 128 against 512 B BF16), so ``max_total_num_tokens =
  available // cell`` grows by the real compression;
* ``KVCacheConfigurator._profile_available_bytes`` subtracts the fixed bytes first: an exact region of ``sink +
  recent`` bf16 rows per layer for each of the ``--max-running-requests + 1`` request slots (row 0 pads CUDA
  graphs; the flag is required), the anchor entries (same size each), and the decode/extend plan workspaces
  (their own ``workspace_bytes()``), see :mod:`.sizing`;
* ``KVCacheConfigurator._build_mha_kv_pool`` builds ``OscarTokenToKVPool`` (a ``KVCache`` holding the rank's
  :class:`~.core.OscarKV`), INT2 codes plus scale/zero per token slot in the artifact's rotated basis.

**The backend** (:func:`.plugin.backend_class`, core in :class:`.core.OscarAttention`). ``init_forward_metadata``
plans a batch through ``DecodePlan.plan`` / ``ExtendPlan.plan`` (index lists filled on the device from
``req_to_token``, no host sync); ``forward_decode`` / ``forward_extend`` call ``run`` per layer (write the new
tokens' INT2 codes and exact rows, then attention). CUDA graphs as 0.5.17 drives them: decode ``full`` graphs call
``init_cuda_graph_state(max_bs, max_num_tokens)`` once, ``get_cuda_graph_seq_len_fill_value()`` (1) for padded
rows, ``init_forward_metadata_out_graph(batch, in_capture=True)`` before each capture and
``init_forward_metadata_out_graph(view)`` eagerly before every replay (padded request rows, live ``out_cache_loc``,
which ``DecodePlan.plan`` pads with slot 0 inside its lengths kernel: three eager launches per step, the anchor
table's slot clear and the plan's two), ``init_forward_metadata_in_graph`` (base no-op) inside; the graph holds
``DecodePlan.run``, which touches only plan and pool buffers. Prefill ``breakable`` graphs run attention eagerly
between graph segments and call ``init_forward_metadata`` with the live batch; ``full`` prefill graphs are refused.

**Exact prefix caching through anchors** (:mod:`.anchors`). A query at ``t >= a`` reads a cached prefix ``[0, a)``
through INT2 codes (shared slots, written once) except its sinks and last ``recent`` positions, which it reads
exactly, and those rows existed only in the region of the request that computed them. So reuse stops at *anchors*:
positions ``a`` whose rows (sinks ``[0, min(sink, a))``, ring ``[max(sink, a - recent), a)``) the pool holds in one of
``anchors`` entries (extra exact regions).

* Taken at the end of every extend chunk and every ``anchor_interval`` positions inside one (rows before the chunk
  from the request's region, rows inside it from the chunk's k/v, before the chunk's attention overwrites the
  ring), and when a request finishes (``cache_finished_req``; only with ``--disable-overlap-schedule``: with
  overlap SGLang runs one more decode step for a finished request before its finish is processed, which
  overwrites a ring row).
* Keyed by the slot holding position ``a - 1`` (``anchor_of_slot`` on the device); every write to a slot clears its
  key, so a freed and reused slot never serves a stale anchor. Entries come from a host FIFO that skips pinned ones.
* ``--radix-cache-backend oscar`` (0.5.17's radix-cache registry, required with the backend) builds
  ``OscarRadixCache(RadixCache)``: ``match_prefix`` for a request (``params.req`` set) caps the match to the deepest
  anchored position (one device lookup, one small host read) by re-matching with ``RadixKey(limit=a)``, so SGLang
  splits the node and locks exactly that prefix; SGLang already keeps >= 1 token to compute. The anchor is pinned
  until the request's first extend has planned its restore (or the request ends, or 256 batches pass without a new
  match: a request aborted while waiting); SGLang's own re-match inside ``cache_unfinished_req`` (no ``req``) is
  never capped. Every TP rank must cap alike: a match first waits for the event recorded after the last batch's
  table updates (under overlap scheduling that batch may still be on the GPU), and pins never end on garbage
  collection.
* At a request's first extend with a prefix (host-tracked by request id; a chunked-prefill continuation is not a
  first extend), the anchor's rows are copied into the request's region per layer before attention (device gather
  through ``anchor_of_slot[req_to_token[req, a - 1]]``, no host sync).

Result: a request reusing an anchored prefix computes exactly what it would without reuse (tested on CPU through
the kernels); ``cached_tokens`` counts the anchored prefix.

**Tensor parallelism** (:mod:`.tp`). Rank ``r`` of ``tp`` holds KV heads ``[r Hkv/tp, (r+1) Hkv/tp)``: the artifact's
per-head rotations and clips are sliced to them (a shared rotation is kept), the pool, its cell size and the kernel
arguments use ``Hkv/tp`` heads. A TP size that does not divide the KV heads (or exceeds them) is refused.

**Refusals** (:mod:`.refusals`): one line each at start, in the launcher before any process is spawned
(``ServerArgs.check_server_args`` AFTER hook) and again where the scheduler builds the pool.

``launch.build_launch`` builds the server command and environment; ``benchmarks/sglang_h200.sh`` is the GPU run.
Served on an H200 in unmodified SGLang 0.5.17 (``benchmarks/RESULTS.md``: SmolLM2 with a per-head artifact and
CUDA graphs, a shared prefix reused through anchors, KV capacity at Qwen3-8B shapes); the greedy comparison against
the project's own cache path has not run there yet. On CPU the contract, pool, backend and prefix-caching logic are
tested against the 0.5.17 source and the kernels' interpreter, and ``tests/serve/test_sglang_live.py`` drives the
plugin through SGLang's own code where SGLang is importable.
"""

from __future__ import annotations


def register() -> None:
    """Entry point ``[sglang.srt.plugins] oscar`` (see the module docstring)."""
    from .plugin import install

    install()
