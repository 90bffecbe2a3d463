from pathlib import Path

import pytest

from oscar_cli.config import ConfigError, EvalConfig, FitConfig, QuantScheme, load_recipe, parse_layers
from oscar_cli.methods import ROTATIONS

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def test_parse_layers():
    assert parse_layers("all", 4) == [0, 1, 2, 3]
    assert parse_layers("0-2,9", 10) == [0, 1, 2, 9]
    with pytest.raises(ConfigError, match="out of range.*0-9"):
        parse_layers("3-12", 10)
    with pytest.raises(ConfigError, match="is not 'all'"):
        parse_layers("a-b", 10)
    with pytest.raises(ConfigError, match=r"range 5-2 runs backwards; write it low-high \(2-5\)"):
        parse_layers("5-2", 10)


def test_shipped_recipes_mean_what_they_say():
    """Each shipped recipe parses into the settings its comments promise (not just "it loads")."""
    smol = load_recipe(RECIPES / "smollm2-135m.yaml")
    assert smol.model == "smollm2-135m"
    assert (smol.collect.tokens, smol.collect.seq_len, smol.collect.batch_size) == (16384, 512, 4)
    assert smol.fit.method == "oscar" and smol.fit.per_head
    assert smol.fit.clip_criterion == "logit-kl" and smol.fit.sensitivity_tokens == 1024
    assert smol.fit.scheme == QuantScheme(bits=2, group=0, sink=16, recent=64, scale_dtype="fp8")
    assert smol.fit.bits_per_element == 2.5
    assert smol.eval.methods == ("bf16", "int2-naive", "int2-hadamard", "oscar") and smol.eval.seq_lengths == (1024,)
    assert [(t.method, t.bound, t.value, t.baseline) for t in smol.thresholds] == [
        ("oscar", "max_ratio", 1.15, "bf16"), ("oscar", "max_ratio", 0.80, "int2-hadamard")]
    qwen = load_recipe(RECIPES / "qwen3-8b.yaml")
    assert qwen.fit.scheme.resolved(128).bits_per_element(128) == 2.25
    assert (qwen.fit.scheme.sink, qwen.fit.scheme.recent) == (64, 256) and qwen.thresholds == ()
    abl = load_recipe(RECIPES / "ablation.yaml")
    assert len(abl.eval.methods) == 16 and abl.eval.overrides == {"sink": 16, "recent": 64}
    assert all(m.split("@")[0] in ("bf16", "int2-naive", "int2-kivi", "int2-hadamard", "int2-hadamard-clip", "oscar",
                                   "oscar-noclip") for m in abl.eval.methods)
    assert {m.split("@fit:")[1].split("+")[0] for m in abl.eval.methods if "@fit:" in m} <= set(ROTATIONS)
    gemma = load_recipe(RECIPES / "gemma3-270m.yaml")
    assert gemma.model == "gemma3-270m" and gemma.fit.scheme.scale_dtype == "fp8"
    assert (gemma.fit.bits_per_element, gemma.fit.context, gemma.fit.clip_criterion) == (2.5, 32768, "layer-local")
    assert gemma.fit.key_split == 64 and gemma.fit.scheme.resolved(256).check_split(256) == 256


def test_a_recipe_that_is_not_utf8_is_one_line(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_bytes("model: smollm2-135m\n# caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(byte 25.*save it as UTF-8"):
        load_recipe(p)


def test_unknown_keys_are_errors(tmp_path):
    p = tmp_path / "r.yaml"
    for text, needle in [("fit:\n  methd: oscar\n", "unknown key.*methd"),
                         ("fit:\n  scheme:\n    bitz: 2\n", "unknown key.*bitz"),
                         ("colect: {}\n", "unknown section"),
                         ("eval:\n  methods: [bf16]\n  ablation: true\n", "unknown key.*ablation"),
                         ("fit:\n  scheme:\n    bits: 3\n", "bits must be 2 or 4"),
                         ("eval: 1.0\n", "eval must be a mapping"), ("eval: [null]\n", "eval must be a mapping"),
                         ("fit: [1]\n", "fit must be a mapping")]:
        p.write_text(text)
        with pytest.raises(ConfigError, match=needle):
            load_recipe(p)


@pytest.mark.parametrize("thresholds,needle", [
    ("- {method: int4-naive, task: oscar_ppl, metric: ppl, max: 10}", "does not run"),
    ("- {method: oscar, task: ruler, metric: ppl, max: 10}", "task 'ruler'"),
    ("- {method: oscar, task: oscar_ppl, metric: ppl}", "exactly one of"),
    ("- {method: oscar, task: oscar_ppl, metric: ppl, max: 1, min: 0}", "exactly one of"),
    ("- {method: oscar, task: oscar_ppl, metric: ppl, max_ratio: 1.1, baseline: int2-kivi}", "compares with"),
    ("- {method: oscar, task: oscar_ppl, metric: ppl, max: 9, baseline: bf16}", "absolute bound"),
    ("- {method: oscar, task: oscar_ppl, metric: ppl, seq_len: 4096, max: 9}", "seq_len 4096"),
    ("- {method: oscar, task: oscar_ppl, metric: ppl, maximum: 9}", "unknown key.*maximum"),
    ("{oscar_ppl_max_ratio_to_bf16: 1.5}", "must be a list"),
])
def test_thresholds_must_be_checkable(tmp_path, thresholds, needle):
    """Unused keys are errors: a threshold about a method, task or length the eval does not run is refused."""
    p = tmp_path / "r.yaml"
    p.write_text("eval:\n  tasks: [oscar_ppl]\n  methods: [bf16, int2-hadamard, oscar]\n  seq_lengths: [1024]\n"
                 f"thresholds:\n  {thresholds}\n")
    with pytest.raises(ConfigError, match=needle):
        load_recipe(p)


def test_thresholds_on_expanded_tasks_and_their_bounds(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("eval:\n  tasks: [ruler]\n  methods: [bf16, oscar]\n  seq_lengths: [4096]\n  sink: 16\n"
                 "thresholds:\n  - {method: oscar, task: niah_single_1, metric: '4096', min: 0.5}\n"
                 "  - {method: oscar, task: niah_single_1, metric: '4096', min_ratio: 0.75}\n")
    r = load_recipe(p)
    lo, rel = r.thresholds
    assert lo.holds(0.5, None) and not lo.holds(0.45, None)
    assert rel.holds(0.8, 1.0) and not rel.holds(0.7, 1.0)
    assert r.eval.overrides == {"sink": 16}
    p.write_text("thresholds:\n  - {method: oscar, task: oscar_ppl, metric: ppl, max: 9}\n")
    with pytest.raises(ConfigError, match="no eval section"):
        load_recipe(p)


def test_bad_values():
    with pytest.raises(ConfigError, match="unknown rotation 'nope' for fit --method; choose one of identity"):
        FitConfig(method="nope")
    assert FitConfig(method="kcov-uh").rotation is ROTATIONS["kcov-uh"]
    with pytest.raises(ConfigError, match="--limit"):
        EvalConfig(limit=0)
    with pytest.raises(ConfigError, match="cannot override 'levels'"):
        EvalConfig(scheme_overrides=(("levels", 1),))
    with pytest.raises(ConfigError, match="--seq-lengths"):
        EvalConfig(seq_lengths=(1,))

