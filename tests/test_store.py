import subprocess
import sys
import time

import numpy as np
import pytest

from oscar_cli.store import Store, StoreError


def _new_run(st):
    return st.create_run(model_slug="m", model_fingerprint="fp", data_spec="d", data_digest="dd", tokens=8,
                         seq_len=4, batch_size=1, num_batches=2, config={"a": 1}, shape={"n_layers": 1})


def test_batches_round_trip_and_evict(tmp_path):
    st = Store(tmp_path)
    rid = _new_run(st)
    mat = np.random.default_rng(0).standard_normal((4, 4))
    samples = {(0, "k"): (np.array([3, 5]), np.array([0.1, 0.7]), np.random.rand(2, 8).astype(np.float32))}
    st.save_batch(rid, 1, 4, {(0, 0, "q"): (10.0, 10.0, mat)}, samples, 0.7)
    st.save_batch(rid, 2, 8, {(0, 0, "q"): (20.0, 20.0, 2 * mat)}, None, 0.5)
    stats = st.load_stats(rid)
    assert stats[(0, 0, "q")][0] == 20.0
    np.testing.assert_array_equal(stats[(0, 0, "q")][2], 2 * mat)
    kept = st.load_samples(rid)[(0, "k")]
    assert kept[0].tolist() == [3]  # priority 0.7 > 0.5 was evicted
    np.testing.assert_array_equal(kept[2], samples[(0, "k")][2][:1])
    run = st.get_run(rid)
    assert (run.batches_done, run.tokens_done, run.status) == (2, 8, "running")


def test_latest_ignores_unfinished_runs(tmp_path):
    st = Store(tmp_path)
    rid = _new_run(st)
    with pytest.raises(StoreError, match="no complete calibration run"):
        st.get_run("latest")
    st.set_status(rid, "complete")
    assert st.get_run("latest").run_id == rid
    with pytest.raises(StoreError, match="does not exist"):
        st.get_run(99)


def test_a_second_process_waits_then_refuses_clearly(tmp_path):
    Store(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import duckdb, sys, time; c = duckdb.connect(sys.argv[1]); print('held', flush=True); time.sleep(30)",
         str(tmp_path / "oscar.duckdb")],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        t = time.monotonic()
        with pytest.raises(StoreError, match="busy: another oscar process"):
            Store(tmp_path, lock_timeout=1.0)
        assert time.monotonic() - t >= 1.0
    finally:
        holder.kill()
        holder.wait()
    Store(tmp_path, lock_timeout=5.0)  # usable again once the holder is gone


def test_missing_store_is_a_clear_error(tmp_path):
    with pytest.raises(StoreError, match="run `oscar collect` first"):
        Store(tmp_path / "nope", create=False)


def _filled_store(path):
    """A store with a few MB of samples (several DuckDB blocks)."""
    import duckdb

    Store(path)
    con = duckdb.connect(str(path / "oscar.duckdb"))
    con.execute("INSERT INTO samples SELECT 1, 0, 'k', i, random(), [random() for x in range(64)]::FLOAT[] "
                "FROM range(20000) t(i)")
    con.close()
    return path / "oscar.duckdb"


@pytest.mark.parametrize("damage", ["truncate-half", "truncate-tail", "garbage-header", "tiny", "flipped-block"])
def test_a_damaged_store_is_refused_before_anything_writes(tmp_path, damage):
    """A truncated, overwritten or bit-flipped database is refused in one line when the store opens, by every command
    that would write into it, and the file stays as it was (same bytes, no write-ahead log appears)."""
    from typer.testing import CliRunner

    from oscar_cli.cli import app

    db = _filled_store(tmp_path / "s")
    data = bytearray(db.read_bytes())
    if damage == "truncate-half":
        data = data[: len(data) // 2]
    elif damage == "truncate-tail":
        data = data[: len(data) - 4096]
    elif damage == "garbage-header":
        data[:4096] = bytes(range(256)) * 16
    elif damage == "flipped-block":  # a data block's bytes changed in place: same size, its checksum fails
        mid = len(data) // 2
        data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
    else:
        data = data[:100]
    db.write_bytes(bytes(data))
    for create in (True, False):
        with pytest.raises(StoreError, match="is damaged.*nothing was written") as e:
            Store(tmp_path / "s", create=create)
        assert "\n" not in str(e.value)
    for args in (["collect", "--model", str(tmp_path / "no-model")], ["fit"], ["runs"],
                 ["eval", "--tasks", "oscar_ppl", "--methods", "bf16"]):
        r = CliRunner().invoke(app, [*args, "--store", str(tmp_path / "s")])
        assert r.exit_code == 1 and "is damaged" in r.output and r.output.strip().count("\n") <= 1, (args, r.output)
    assert db.read_bytes() == bytes(data) and sorted(p.name for p in (tmp_path / "s").iterdir()) == ["oscar.duckdb"]


def test_a_full_disk_mid_batch_rolls_back_and_says_so(tmp_path, monkeypatch):
    """ENOSPC while a batch's transaction writes (after its statistics, before its samples): one line naming the
    full disk and the fix; the store holds the previous batch exactly (statistics, reservoir, progress)."""
    import contextlib

    import duckdb

    st = Store(tmp_path)
    rid = _new_run(st)
    mat = np.random.default_rng(1).standard_normal((4, 4))
    samples = {(0, "k"): (np.array([3]), np.array([0.2]), np.ones((1, 8), np.float32))}
    st.save_batch(rid, 1, 4, {(0, 0, "q"): (10.0, 10.0, mat)}, samples, None)
    real = Store._connect

    class FullDisk:
        def __init__(self, con):
            self.con = con

        def execute(self, sql, *a):
            if "samples" in sql and "INSERT" in sql.upper():
                raise duckdb.IOException('IO Error: Could not write file "oscar.duckdb": No space left on device')
            return self.con.execute(sql, *a)

        def __getattr__(self, name):
            return getattr(self.con, name)

    @contextlib.contextmanager
    def full_disk(self, read_only=False):
        with real(self, read_only) as con:
            yield con if read_only else FullDisk(con)

    monkeypatch.setattr(Store, "_connect", full_disk)
    more = {(0, "k"): (np.array([9]), np.array([0.1]), np.zeros((1, 8), np.float32))}
    with pytest.raises(StoreError, match="the disk is full.*nothing of this step was stored.*free space") as e:
        st.save_batch(rid, 2, 8, {(0, 0, "q"): (20.0, 20.0, 2 * mat)}, more, None)
    assert "\n" not in str(e.value)
    monkeypatch.setattr(Store, "_connect", real)
    stats = st.load_stats(rid)
    assert stats[(0, 0, "q")][0] == 10.0
    np.testing.assert_array_equal(stats[(0, 0, "q")][2], mat)
    assert st.load_samples(rid)[(0, "k")][0].tolist() == [3]
    assert st.get_run(rid).batches_done == 1


def test_a_store_created_by_another_process_first_is_opened_not_created_again(tmp_path, monkeypatch):
    """Two commands creating one store at once: the one that gets the file second finds the other's store (whether
    the store is new is decided under the file lock, not by a look at the file before it)."""
    real = Store._connect
    raced = []

    def other_process_first(self, read_only=False):
        if not raced:  # between this process's look at the folder and its connection, another creates the store
            raced.append(True)
            _new_run(Store(self.root))
        return real(self, read_only)

    monkeypatch.setattr(Store, "_connect", other_process_first)
    st = Store(tmp_path)
    assert raced and [r.run_id for r in st.list_runs()] == [1]
    assert st.schema_version() == Store(tmp_path).schema_version()
    assert _new_run(st) == 2


def test_a_version_1_store_is_migrated_in_place_and_a_newer_one_refused(tmp_path):
    """A store written before the schema version existed (no ``meta`` table) keeps its runs and statistics and is
    migrated to the current version when opened for writing; read-only opens leave it as it is; a store of a newer
    version is refused in one line."""
    import duckdb

    from oscar_cli import store as store_mod

    db = tmp_path / "old" / "oscar.duckdb"
    db.parent.mkdir()
    con = duckdb.connect(str(db))
    con.execute(store_mod.SCHEMA)  # the tables as version 1 made them, no meta table
    con.close()
    st = Store(tmp_path / "old", create=False)
    assert st.schema_version() == 1  # opened without writing: not migrated
    st = Store(tmp_path / "old")
    assert st.schema_version() == store_mod.STORE_SCHEMA and st.migrate() == []
    rid = _new_run(st)
    assert st.get_run(rid).status == "running"
    fresh = Store(tmp_path / "fresh")
    assert fresh.schema_version() == store_mod.STORE_SCHEMA
    con = duckdb.connect(str(tmp_path / "fresh" / "oscar.duckdb"))
    con.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    con.close()
    for create in (True, False):
        with pytest.raises(StoreError, match="schema version 99, written by a newer oscar-kv") as e:
            Store(tmp_path / "fresh", create=create)
        assert "\n" not in str(e.value)
