from pathlib import Path

import pytest

from oscar_cli.config import ConfigError, FitConfig, QuantConfig, load_recipe, parse_layers

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def test_parse_layers():
    assert parse_layers("all", 4) == [0, 1, 2, 3]
    assert parse_layers("0-2,9", 10) == [0, 1, 2, 9]
    with pytest.raises(ConfigError, match="out of range.*0-9"):
        parse_layers("3-12", 10)
    with pytest.raises(ConfigError, match="is not 'all'"):
        parse_layers("a-b", 10)


@pytest.mark.parametrize("name", sorted(p.name for p in RECIPES.glob("*.yaml")))
def test_shipped_recipes_load(name):
    r = load_recipe(RECIPES / name)
    assert r.collect.tokens > 0 and r.fit.method


def test_unknown_keys_are_errors(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("fit:\n  methd: oscar\n")
    with pytest.raises(ConfigError, match="unknown key.*methd"):
        load_recipe(p)
    p.write_text("fit:\n  quant:\n    bitz: 2\n")
    with pytest.raises(ConfigError, match="unknown key.*bitz"):
        load_recipe(p)
    p.write_text("colect: {}\n")
    with pytest.raises(ConfigError, match="unknown section"):
        load_recipe(p)


def test_bad_values():
    with pytest.raises(ConfigError, match="unknown method"):
        FitConfig(method="nope")
    with pytest.raises(ConfigError, match="bits"):
        QuantConfig(bits=3)
    with pytest.raises(ConfigError, match="must divide"):
        QuantConfig(group=48).group_for(64)
