"""The run's scheme decisions (the method loop itself runs in tests/test_cli_eval.py through ``oscar eval``)."""

from types import SimpleNamespace

import pytest

from oscar_cli.config import QuantScheme
from oscar_cli.eval import EvalError
from oscar_cli.eval.run import reference_scheme


def art(name, sink, recent):
    return SimpleNamespace(name=name, scheme=QuantScheme(bits=2, sink=sink, recent=recent))


def test_data_free_methods_take_the_artifacts_sink_and_recent():
    assert reference_scheme({}, {}) == QuantScheme()
    one = {"a": art("m/v1", 16, 64), "b": art("m/v2", 16, 64)}
    assert reference_scheme(one, {}) == QuantScheme(sink=16, recent=64)
    two = {"a": art("m/v1", 16, 64), "b": art("m/v2", 64, 256)}
    with pytest.raises(EvalError, match=r"m/v1 \(16/64\), m/v2 \(64/256\); pass --sink and --recent") as e:
        reference_scheme(two, {"sink": 8})
    assert "\n" not in str(e.value)
    assert reference_scheme(two, {"sink": 8, "recent": 32}) == QuantScheme()  # the overrides then set every method's
