"""The DuckDB store (the only module that imports duckdb).

``<store>/oscar.duckdb`` holds

* ``runs``: one row per calibration run: model slug and fingerprint, data spec and digest, tokens, seq len, batch
  size, progress (``batches_done``, at the last checkpoint), ``status`` (running / complete / interrupted), the owning
  process, config JSON;
* ``stats``: float64 accumulators per (run, layer, head, kind): ``count`` (rows), ``weight`` (sum of weights),
  ``mat`` (the d×d sum of outer products, row-major);
* ``samples``: the bounded reservoir, one row per (run, layer, kind, token) with all heads of that token concatenated
  (``kind`` q: ``[n_heads * d]``; k, v: ``[n_kv_heads * d]``) and the token's sampling priority;
* ``artifacts``: every artifact written by ``oscar fit`` (path, version, method, fingerprint, content hash);
* ``evals``: one row per metric from ``oscar eval``.

Every write is one transaction on a short-lived connection, so a killed process leaves the store as it was after the
last completed batch, and readers can open the store between a writer's batches. When another process holds the
database, operations wait up to ``lock_timeout`` seconds and then fail with a clear message.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import OscarError
from .files import pid_alive

DB_FILE = "oscar.duckdb"
SCHEMA = """
CREATE SEQUENCE IF NOT EXISTS run_ids START 1;
CREATE TABLE IF NOT EXISTS runs (
    run_id BIGINT PRIMARY KEY, created TIMESTAMP, model_slug VARCHAR, model_fingerprint VARCHAR,
    data_spec VARCHAR, data_digest VARCHAR, tokens BIGINT, seq_len INTEGER, batch_size INTEGER,
    num_batches INTEGER, batches_done INTEGER, tokens_done BIGINT, status VARCHAR, owner_pid INTEGER,
    owner_host VARCHAR, config JSON, shape JSON, updated TIMESTAMP);
CREATE TABLE IF NOT EXISTS stats (
    run_id BIGINT, layer INTEGER, head INTEGER, kind VARCHAR, count DOUBLE, weight DOUBLE, mat DOUBLE[]);
CREATE TABLE IF NOT EXISTS samples (
    run_id BIGINT, layer INTEGER, kind VARCHAR, token BIGINT, priority DOUBLE, row FLOAT[]);
CREATE SEQUENCE IF NOT EXISTS artifact_ids START 1;
CREATE TABLE IF NOT EXISTS artifacts (
    artifact_id BIGINT PRIMARY KEY, created TIMESTAMP, model_slug VARCHAR, version INTEGER, path VARCHAR,
    run_id BIGINT, method VARCHAR, model_fingerprint VARCHAR, content_hash VARCHAR, manifest JSON);
CREATE SEQUENCE IF NOT EXISTS eval_ids START 1;
CREATE TABLE IF NOT EXISTS evals (
    eval_id BIGINT PRIMARY KEY, created TIMESTAMP, model_fingerprint VARCHAR, model_slug VARCHAR, method VARCHAR,
    artifact VARCHAR, task VARCHAR, metric VARCHAR, value DOUBLE, config JSON, bits_per_element DOUBLE,
    lm_eval_version VARCHAR);
"""


class StoreError(OscarError):
    pass


STORE_SCHEMA = 2
"""Version 2: a ``meta`` table records the schema version. Version 1 (stores written before it, no ``meta``) is
migrated in place when a command that may write opens the store (:data:`MIGRATIONS`)."""
MIGRATIONS = {
    1: ["CREATE TABLE IF NOT EXISTS meta (key VARCHAR PRIMARY KEY, value VARCHAR)"],
}
"""SQL that takes a store from version ``v`` to ``v + 1``, run in one transaction with the version update."""


DB_HEADER_BYTES = 3 * 4096
"""DuckDB's file header (one main and two database headers of 4 KiB) before its blocks."""
_READ_BACK = ("SELECT * FROM runs", "SELECT * FROM artifacts", "SELECT * FROM evals",
              "SELECT count(*), sum(count), sum(list_sum(mat)) FROM stats",
              "SELECT count(*), sum(priority), sum(list_sum(row)) FROM samples")
"""Queries that read every stored value of every table (a damaged block fails its checksum or its read)."""
_CHECKED: set[tuple[str, int, int]] = set()
"""(path, size, mtime) of the database files this process found intact."""


@dataclass(frozen=True)
class Run:
    run_id: int
    model_slug: str
    model_fingerprint: str
    data_spec: str
    data_digest: str
    tokens: int
    seq_len: int
    batch_size: int
    num_batches: int
    batches_done: int
    tokens_done: int
    status: str
    owner_pid: int | None
    owner_host: str | None
    config: dict
    shape: dict

    @property
    def live_status(self) -> str:
        """``status``, except that a run marked running whose process on this host is gone reads ``interrupted``
        (killed with SIGKILL or a power loss: nothing got to record it; ``oscar collect --resume`` continues it)."""
        if self.status == "running" and self.owner_host == _host() and not pid_alive(self.owner_pid):
            return "interrupted"
        return self.status


_RUN_COLS = [f for f in Run.__dataclass_fields__]


def _host() -> str:
    return os.uname().nodename


class Store:
    """A store folder. Every public method opens, uses and closes its own connection."""

    def __init__(self, root: Path, lock_timeout: float = 60.0, create: bool = True):
        self.root = Path(root)
        self.path = self.root / DB_FILE
        self.lock_timeout = lock_timeout
        if not create and not self.path.is_file():
            raise StoreError(f"no store at {self.root}; run `oscar collect` first or pass --store")
        if self.path.is_file():
            self.check()  # a damaged store is refused before anything writes into it
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
            with self._connect() as con:
                # fresh or not is decided under the connection's file lock: another process may have created the
                # store between a look at the file and this connection
                fresh = not con.execute("SELECT count(*) FROM information_schema.tables").fetchone()[0]
                con.execute(SCHEMA)
                if fresh:
                    con.execute(MIGRATIONS[1][0])
                    con.execute("INSERT INTO meta VALUES ('schema_version', ?)", [str(STORE_SCHEMA)])
            self.migrate()
        elif self.schema_version() > STORE_SCHEMA:
            raise self._newer()

    def _newer(self) -> StoreError:
        return StoreError(f"store {self.path} has schema version {self.schema_version()}, written by a newer oscar-kv "
                          f"(this one reads up to {STORE_SCHEMA}); upgrade oscar-kv or use another --store")

    def schema_version(self) -> int:
        """The store's schema version (1: written before the ``meta`` table existed)."""
        with self._connect(read_only=True) as con:
            has_meta = con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = 'meta'"
                                   ).fetchone()[0]
            if not has_meta:
                return 1
            row = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        return int(row[0]) if row else 1

    def migrate(self) -> list[int]:
        """Bring the store to :data:`STORE_SCHEMA`, one transaction per step (an interrupted migration leaves a
        store of the previous version); returns the versions migrated from. A newer store is refused."""
        done = []
        version = self.schema_version()
        if version > STORE_SCHEMA:
            raise self._newer()
        while version < STORE_SCHEMA:
            with self.transaction() as con:
                for sql in MIGRATIONS[version]:
                    con.execute(sql)
                con.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", [str(version + 1)])
            done.append(version)
            version += 1
        return done

    @classmethod
    def verify(cls, root: Path) -> None:
        """Refuse a damaged store at ``root`` (if there is one) without creating anything: what a command runs
        before its slow steps, so that it fails before loading a model rather than after."""
        path = Path(root) / DB_FILE
        if path.is_file():
            cls(root, create=False)

    def _io_error(self, e: Exception) -> StoreError:
        """A failed read or write of the database as one line: a full disk says so (the transaction that hit it
        rolled back: the store is as it was before it), anything else reads as damage."""
        first = str(e).splitlines()[0][:160]
        if "no space left" in str(e).lower() or "disk full" in str(e).lower():
            return StoreError(f"store {self.path}: the disk is full ({first}); nothing of this step was stored (the "
                              "store is as before it): free space, then run the command again (collect: --resume)")
        return self._damaged(f"{type(e).__name__} while reading it: {first}")

    def _damaged(self, why: str) -> StoreError:
        return StoreError(f"store {self.path} is damaged ({why}); nothing was written to it: restore a copy, or move "
                          f"it aside and run `oscar collect` into a fresh store")

    def check(self) -> None:
        """Refuse a damaged database file (read-only, nothing written): shorter than the blocks in use, a header or
        catalog that does not parse, or any stored value that cannot be read back (every table is read whole: ~0.2 s
        for a 150 MB store; once per process for each state of the file)."""
        import duckdb

        stat = self.path.stat()
        key = (str(self.path.resolve()), stat.st_size, stat.st_mtime_ns)
        if key in _CHECKED:
            return
        try:
            with self._connect(read_only=True) as con:
                # sizes read while this connection holds the file: a writer that closed just before may have
                # checkpointed into it since the first look
                stat = self.path.stat()
                key = (str(self.path.resolve()), stat.st_size, stat.st_mtime_ns)
                if stat.st_size < DB_HEADER_BYTES:
                    raise self._damaged(f"{stat.st_size} bytes, less than a database header")
                block, used = con.execute("SELECT block_size, used_blocks FROM pragma_database_size()").fetchone()
                want = DB_HEADER_BYTES + int(block) * int(used)  # free blocks at the end may be cut off, used ones not
                wal = self.path.with_name(self.path.name + ".wal")
                # with a write-ahead log not yet checkpointed, blocks in use may still live in the log alone
                if stat.st_size < want and not (wal.is_file() and wal.stat().st_size > 0):
                    raise self._damaged(f"truncated: {stat.st_size} bytes, fewer than the {want} its blocks in use "
                                        "need")
                for query in _READ_BACK:
                    con.execute(query).fetchall()
        except duckdb.Error as e:
            raise self._damaged(f"{type(e).__name__}: {str(e).splitlines()[0][:160]}") from None
        _CHECKED.add(key)

    @contextmanager
    def _connect(self, read_only: bool = False):
        import duckdb

        deadline = time.monotonic() + self.lock_timeout
        delay = 0.05
        while True:
            try:
                con = duckdb.connect(str(self.path), read_only=read_only and self.path.is_file())
                break
            except duckdb.IOException as e:
                msg = str(e)
                if "lock" not in msg.lower():
                    raise self._damaged(f"cannot open it: {msg.splitlines()[0][:160]}") from None
                if time.monotonic() > deadline:
                    raise StoreError(
                        f"store {self.path} is busy: another oscar process holds it for more than "
                        f"{self.lock_timeout:.0f} s; wait for it to finish or pass a different --store"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
            except duckdb.Error as e:  # a header or catalog that does not parse
                raise self._damaged(f"cannot open it: {type(e).__name__}: {str(e).splitlines()[0][:160]}") from None
        try:
            yield con
        except (duckdb.IOException, duckdb.FatalException, duckdb.InternalException) as e:
            raise self._io_error(e) from None
        finally:
            con.close()

    @contextmanager
    def transaction(self):
        with self._connect() as con:
            con.execute("BEGIN TRANSACTION")
            try:
                yield con
            except BaseException:
                con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")

    # ---------------------------------------------------------------- runs
    def create_run(self, *, model_slug, model_fingerprint, data_spec, data_digest, tokens, seq_len, batch_size,
                   num_batches, config: dict, shape: dict) -> int:
        with self.transaction() as con:
            run_id = con.execute("SELECT nextval('run_ids')").fetchone()[0]
            con.execute(
                "INSERT INTO runs VALUES (?, now(), ?, ?, ?, ?, ?, ?, ?, ?, 0, 0, 'running', ?, ?, ?, ?, now())",
                [run_id, model_slug, model_fingerprint, data_spec, data_digest, tokens, seq_len, batch_size,
                 num_batches, os.getpid(), _host(), json.dumps(config), json.dumps(shape)],
            )
        return int(run_id)

    def get_run(self, ref: str | int = "latest", model_slug: str | None = None) -> Run:
        """A run by id, or ``latest`` (the newest complete run, of ``model_slug`` if given)."""
        with self._connect(read_only=True) as con:
            cols = ", ".join(_RUN_COLS)
            if str(ref) == "latest":
                q = f"SELECT {cols} FROM runs WHERE status = 'complete'"
                args: list = []
                if model_slug:
                    q += " AND model_slug = ?"
                    args.append(model_slug)
                row = con.execute(q + " ORDER BY run_id DESC LIMIT 1", args).fetchone()
                if row is None:
                    raise StoreError(f"no complete calibration run in {self.root}; run `oscar collect` first")
            else:
                try:
                    rid = int(ref)
                except ValueError:
                    raise StoreError(f"--run {ref!r} is not a run id or 'latest'") from None
                row = con.execute(f"SELECT {cols} FROM runs WHERE run_id = ?", [rid]).fetchone()
                if row is None:
                    raise StoreError(f"run {rid} does not exist in {self.root}; `oscar runs` lists them")
        d = dict(zip(_RUN_COLS, row, strict=True))
        d["config"], d["shape"] = json.loads(d["config"]), json.loads(d["shape"])
        return Run(**d)

    def list_runs(self) -> list[Run]:
        with self._connect(read_only=True) as con:
            ids = [r[0] for r in con.execute("SELECT run_id FROM runs ORDER BY run_id").fetchall()]
        return [self.get_run(i) for i in ids]

    def find_resumable(self, model_fingerprint: str, data_digest: str, seq_len: int, batch_size: int) -> Run | None:
        """The newest unfinished run with the same model, data and batching."""
        with self._connect(read_only=True) as con:
            row = con.execute(
                "SELECT run_id FROM runs WHERE status <> 'complete' AND model_fingerprint = ? AND data_digest = ? "
                "AND seq_len = ? AND batch_size = ? ORDER BY run_id DESC LIMIT 1",
                [model_fingerprint, data_digest, seq_len, batch_size],
            ).fetchone()
        return self.get_run(row[0]) if row else None

    def claim_run(self, run: Run) -> None:
        """Take ownership of an unfinished run; refuse if a live process on this host owns it."""
        if run.status == "running" and run.owner_host == _host() and run.owner_pid != os.getpid() \
                and pid_alive(run.owner_pid):
            raise StoreError(
                f"run {run.run_id} is being collected by process {run.owner_pid}; wait for it or stop it first"
            )
        with self.transaction() as con:
            con.execute("UPDATE runs SET status = 'running', owner_pid = ?, owner_host = ?, updated = now() "
                        "WHERE run_id = ?", [os.getpid(), _host(), run.run_id])

    def set_status(self, run_id: int, status: str) -> None:
        with self.transaction() as con:
            con.execute("UPDATE runs SET status = ?, updated = now() WHERE run_id = ?", [status, run_id])

    # ---------------------------------------------------------------- statistics
    def save_batch(self, run_id: int, batches_done: int, tokens_done: int, stats: dict, samples: dict | None,
                   sample_threshold: float | None) -> None:
        """Replace the run's accumulators with ``stats`` and merge reservoir changes, in one transaction.

        ``stats``: {(layer, head, kind): (count, weight, float64 [d, d])}. ``samples``: {(layer, kind): (tokens int64
        [n], priorities float64 [n], rows float32 [n, w])} of rows that entered the reservoir; rows whose priority is
        above ``sample_threshold`` are evicted.
        """
        import pyarrow as pa

        keys = list(stats)
        stat_table = pa.table({
            "run_id": pa.array([run_id] * len(keys), pa.int64()),
            "layer": pa.array([k[0] for k in keys], pa.int32()),
            "head": pa.array([k[1] for k in keys], pa.int32()),
            "kind": pa.array([k[2] for k in keys], pa.string()),
            "count": pa.array([float(stats[k][0]) for k in keys], pa.float64()),
            "weight": pa.array([float(stats[k][1]) for k in keys], pa.float64()),
            "mat": pa.array([np.ascontiguousarray(stats[k][2], dtype=np.float64).reshape(-1) for k in keys],
                            pa.list_(pa.float64())),
        })
        sample_table = None
        if samples:
            cols: dict[str, list] = {"layer": [], "kind": [], "token": [], "priority": [], "row": []}
            for (layer, kind), (tok, pri, rows) in samples.items():
                n = len(tok)
                cols["layer"].append(np.full(n, layer, np.int32))
                cols["kind"].extend([kind] * n)
                cols["token"].append(np.asarray(tok, np.int64))
                cols["priority"].append(np.asarray(pri, np.float64))
                cols["row"].extend(np.asarray(rows, np.float32))
            sample_table = pa.table({
                "run_id": pa.array(np.full(len(cols["kind"]), run_id, np.int64)),
                "layer": pa.array(np.concatenate(cols["layer"])),
                "kind": pa.array(cols["kind"], pa.string()),
                "token": pa.array(np.concatenate(cols["token"])),
                "priority": pa.array(np.concatenate(cols["priority"])),
                "row": pa.array(cols["row"], pa.list_(pa.float32())),
            })
        with self.transaction() as con:
            con.execute("DELETE FROM stats WHERE run_id = ?", [run_id])
            con.register("stat_batch", stat_table)
            con.execute("INSERT INTO stats SELECT * FROM stat_batch")
            if sample_threshold is not None:
                con.execute("DELETE FROM samples WHERE run_id = ? AND priority > ?", [run_id, sample_threshold])
            if sample_table is not None:
                con.register("sample_batch", sample_table)
                con.execute("INSERT INTO samples SELECT * FROM sample_batch")
            con.execute(
                "UPDATE runs SET batches_done = ?, tokens_done = ?, updated = now() WHERE run_id = ?",
                [batches_done, tokens_done, run_id],
            )

    def load_stats(self, run_id: int) -> dict:
        """{(layer, head, kind): (count, weight, float64 ndarray [d, d])}."""
        with self._connect(read_only=True) as con:
            tab = con.sql(f"SELECT layer, head, kind, count, weight, mat FROM stats WHERE run_id = {int(run_id)}")
            tab = tab.to_arrow_table()
        out = {}
        if tab.num_rows == 0:
            return out
        mats = tab.column("mat").combine_chunks()
        flat = mats.flatten().to_numpy(zero_copy_only=False).astype(np.float64, copy=False)  # no Python floats
        offsets = mats.offsets.to_numpy()
        for i, (layer, head, kind, count, weight) in enumerate(zip(
            tab.column("layer").to_pylist(), tab.column("head").to_pylist(), tab.column("kind").to_pylist(),
            tab.column("count").to_pylist(), tab.column("weight").to_pylist(), strict=True,
        )):
            m = flat[offsets[i]:offsets[i + 1]]
            d = int(round(len(m) ** 0.5))
            out[(layer, head, kind)] = (count, weight, m.reshape(d, d).copy())
        return out

    def load_samples(self, run_id: int, layer: int | None = None) -> dict:
        """{(layer, kind): (tokens int64 [n], priorities float64 [n], rows float32 [n, w])}, sorted by priority."""
        q = f"SELECT layer, kind, token, priority, row FROM samples WHERE run_id = {int(run_id)}"
        if layer is not None:
            q += f" AND layer = {int(layer)}"
        with self._connect(read_only=True) as con:
            tab = con.sql(q + " ORDER BY layer, kind, priority, token").to_arrow_table()
        out: dict = {}
        if tab.num_rows == 0:
            return out
        layers = np.asarray(tab.column("layer").to_numpy())
        kinds = np.asarray(tab.column("kind").to_pylist())
        tokens = np.asarray(tab.column("token").to_numpy())
        pri = np.asarray(tab.column("priority").to_numpy())
        rows = tab.column("row").to_pylist()
        for key in sorted({(int(a), str(b)) for a, b in zip(layers, kinds, strict=True)}):
            idx = np.flatnonzero((layers == key[0]) & (kinds == key[1]))
            out[key] = (tokens[idx], pri[idx], np.asarray([rows[i] for i in idx], dtype=np.float32))
        return out

    # ---------------------------------------------------------------- artifacts
    def register_artifact(self, path: Path, manifest: dict) -> int:
        with self.transaction() as con:
            aid = con.execute("SELECT nextval('artifact_ids')").fetchone()[0]
            con.execute(
                "INSERT INTO artifacts VALUES (?, now(), ?, ?, ?, ?, ?, ?, ?, ?)",
                [aid, manifest["model_slug"], int(Path(path).name[1:]), str(Path(path).resolve()),
                 manifest.get("run_id"), manifest["method"], manifest["model_fingerprint"],
                 manifest["content_hash"], json.dumps(manifest)],
            )
        return int(aid)

    def _select(self, table: str, cols: list[str], model_slug: str | None) -> list[dict]:
        """Rows of ``table`` (optionally of one model) as dicts, in insertion order (first column is the id)."""
        q = f"SELECT {', '.join(cols)} FROM {table}"
        args = []
        if model_slug:
            q += " WHERE model_slug = ?"
            args.append(model_slug)
        with self._connect(read_only=True) as con:
            rows = con.execute(q + f" ORDER BY {cols[0]}", args).fetchall()
        return [dict(zip(cols, r, strict=True)) for r in rows]

    def list_artifacts(self, model_slug: str | None = None) -> list[dict]:
        cols = ["artifact_id", "created", "model_slug", "version", "path", "run_id", "method", "content_hash"]
        return self._select("artifacts", cols, model_slug)

    def resolve_artifact(self, ref: str, model_slug: str | None = None) -> Path:
        """``latest``, ``v3``, ``<model>/v3``, a numeric artifact id, or a folder path -> artifact folder."""
        p = Path(ref)
        if ref not in ("latest",) and p.is_dir():
            return p
        arts = self.list_artifacts(model_slug) if self.path.is_file() else []
        if ref == "latest":
            if not arts:
                who = f" for {model_slug}" if model_slug else ""
                raise StoreError(f"no artifact{who} registered in {self.root}; run `oscar fit` first")
            return Path(arts[-1]["path"])
        slug, _, ver = ref.rpartition("/")
        for a in reversed(arts):
            if ref.isdigit() and a["artifact_id"] == int(ref):
                return Path(a["path"])
            if ver.startswith("v") and ver[1:].isdigit() and a["version"] == int(ver[1:]) \
                    and (not slug or a["model_slug"] == slug):
                return Path(a["path"])
        raise StoreError(f"artifact {ref!r} not found in {self.root}; use 'latest', v<N>, <model>/v<N> or a folder")

    # ---------------------------------------------------------------- evals
    def record_evals(self, rows: list[dict]) -> None:
        with self.transaction() as con:
            for r in rows:
                eid = con.execute("SELECT nextval('eval_ids')").fetchone()[0]
                con.execute(
                    "INSERT INTO evals VALUES (?, now(), ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [eid, r["model_fingerprint"], r["model_slug"], r["method"], r.get("artifact"), r["task"],
                     r["metric"], float(r["value"]), json.dumps(r.get("config", {})), r.get("bits_per_element"),
                     r.get("lm_eval_version")],
                )

    def list_evals(self, model_slug: str | None = None) -> list[dict]:
        cols = ["eval_id", "created", "model_slug", "method", "artifact", "task", "metric", "value",
                "bits_per_element"]
        return self._select("evals", cols, model_slug)
