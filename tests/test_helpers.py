"""The test kit itself: the content-keyed fixture cache and the --shuffle option of conftest.py."""

from pathlib import Path

import helpers
import pytest

pytest_plugins = ["pytester"]


def test_cached_build_builds_once_per_key_and_redoes_a_crashed_build(tmp_path, monkeypatch):
    monkeypatch.setattr(helpers, "CACHE", tmp_path / "cache")
    calls = []

    def build(folder):
        calls.append(folder)
        (folder / "out.txt").write_text(str(len(calls)))

    a = helpers.cached_build("thing", {"input": "a"}, build)
    assert helpers.cached_build("thing", {"input": "a"}, build) == a and len(calls) == 1
    assert (a / "out.txt").read_text() == "1"
    assert (a / "out.txt").stat().st_mode & 0o222 == 0  # read-only once built
    b = helpers.cached_build("thing", {"input": "b"}, build)
    assert b != a and len(calls) == 2 and (b / "out.txt").read_text() == "2"

    def crash(folder):
        (folder / "half.txt").write_text("half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        helpers.cached_build("thing", {"input": "c"}, crash)
    c = helpers.cached_build("thing", {"input": "c"}, build)
    assert not (c / "half.txt").exists() and (c / "out.txt").read_text() == "3"


def test_cached_build_keeps_the_most_recently_used_builds(tmp_path, monkeypatch):
    monkeypatch.setattr(helpers, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(helpers, "KEEP", 2)
    made = [helpers.cached_build("thing", {"n": n}, lambda f: None) for n in range(2)]
    helpers.cached_build("thing", {"n": 0}, lambda f: None)  # 0 used after 1
    other = helpers.cached_build("other", {"n": 0}, lambda f: None)
    newest = helpers.cached_build("thing", {"n": 2}, lambda f: None)
    assert made[0].is_dir() and not made[1].exists() and newest.is_dir() and other.is_dir()
    assert sorted(p.name for p in helpers.CACHE.glob("*.lock")) == sorted(
        f"{d.name}.lock" for d in (made[0], newest, other))


def test_tree_digest_follows_content_and_names(tmp_path):
    src = tmp_path / "pkg"
    (src / "__pycache__").mkdir(parents=True)
    (src / "a.py").write_text("x = 1\n")
    first = helpers.tree_digest(src)
    (src / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    assert helpers.tree_digest(src) == first  # bytecode is not content
    (src / "a.py").write_text("x = 2\n")
    second = helpers.tree_digest(src)
    assert second != first
    (src / "a.py").rename(src / "b.py")
    assert helpers.tree_digest(src) not in (first, second)


def _order(result):
    return [line for line in result.outlines if "::test_" in line]


def test_shuffle_reorders_every_test_the_same_way_for_a_seed(pytester, pytestconfig):
    conftest = pytestconfig.pluginmanager.get_plugin(str(Path(__file__).with_name("conftest.py")))
    pytester.makepyfile(test_many="".join(f"def test_{i}():\n    pass\n\n\n" for i in range(30)))
    plain = _order(pytester.runpytest("--collect-only", "-q", plugins=[conftest]))
    first = pytester.runpytest("--collect-only", "-q", "--shuffle", "5", plugins=[conftest])
    again = _order(pytester.runpytest("--collect-only", "-q", "--shuffle", "5", plugins=[conftest]))
    other = _order(pytester.runpytest("--collect-only", "-q", "--shuffle", "6", plugins=[conftest]))
    assert len(plain) == 30 and sorted(_order(first)) == sorted(plain)
    assert _order(first) == again != plain and other not in (plain, again)
    assert "--shuffle 5 repeats it" in first.stdout.str()
    drawn = pytester.runpytest("--collect-only", "-q", "--shuffle", "random", plugins=[conftest])
    seed = drawn.stdout.str().split("--shuffle ")[1].split()[0]
    assert _order(pytester.runpytest("--collect-only", "-q", "--shuffle", seed, plugins=[conftest])) == _order(drawn)
    bad = pytester.runpytest("--collect-only", "-q", "--shuffle", "x1", plugins=[conftest])
    assert bad.ret == pytest.ExitCode.USAGE_ERROR and "integer seed or 'random'" in bad.stderr.str()
