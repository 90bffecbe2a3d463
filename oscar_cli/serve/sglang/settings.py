"""The plugin's settings and the one channel that carries them into every SGLang process.

Channel: SGLang's own ``--json-model-override-args`` with one key, ``"oscar"``::

    --json-model-override-args '{"oscar": {"artifact": "/abs/path/artifacts/smollm2-135m/v3", "anchors": 64}}'

It is a real :class:`ServerArgs` field, so SGLang itself pickles it into the scheduler process of every TP rank,
prints it in its ``server_args=...`` start line, and accepts it from ``launch_server``, ``sglang serve``, a
``--config`` YAML and ``sglang.Engine(json_model_override_args=...)`` alike; no parser hooks in the launcher and no
environment variables. SGLang also sets the key on the model's HF config (``hf_config.oscar``), where nothing reads
it. ``oscar serve --engine sglang`` (:func:`oscar_cli.serve.sglang.launch.build_launch`) writes it, merged into any
override JSON the user passes.

Settings (the quant scheme itself is the artifact's):

* ``artifact``: the artifact folder (absolute path);
* ``anchors``: prefix-cache anchor entries, each ``sink + recent`` exact rows per layer for K and V (fixed memory,
  counted in SGLang's budget);
* ``anchor_interval``: positions between anchors taken inside one extend (0: only at chunk ends and finished
  requests);
* ``int8_scores``, ``int8_values``: the decode kernel's int8 variants (these do change the numerics, within their
  definitions);
* ``decode_tuning``: launch options of the decode kernel that keep its numerics (``lean_tiles``, ``movmatrix``,
  ``num_stages``, ``max_registers``, ``split_tokens``) or change only its rounding (``fused_update``), for
  benchmarking them in the engine.

Pure Python: no torch, no SGLang.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import OscarError

CHANNEL_KEY = "oscar"
"""Key of the plugin's entry in ``--json-model-override-args``."""
DEFAULT_ANCHORS = 64
"""Anchor entries. Each costs ``(sink + recent) * layers * kv_heads * head_dim * 4`` bytes (K and V, bf16): 47 MiB
for Qwen3-8B shapes at sink 64 / recent 256 (3 GiB for 64), 0.3 MiB for SmolLM2-135M at 16 / 64."""
DEFAULT_ANCHOR_INTERVAL = 1024
"""Anchors inside a long extend: a prompt sharing the first ``k * 1024`` tokens with a cached one reuses them even
when the cached prompt went on (a shared 2k-token system prompt followed by different questions)."""


DECODE_TUNING: dict[str, type] = {"lean_tiles": bool, "fused_update": bool, "movmatrix": bool, "num_stages": int,
                                  "max_registers": int, "split_tokens": int}
"""``decode_tuning`` keys (``oscar_kernels.DecodePlan`` / ``decode_int2`` keywords) and their types."""


def parse_decode_tuning(spec: str) -> dict[str, bool | int]:
    """``KEY=VALUE[,KEY=VALUE...]`` (the command-line form of ``decode_tuning``: keys of :data:`DECODE_TUNING`,
    ``true``/``false`` for switches, positive integers for counts) as a dict; :class:`SettingsError` with one line
    naming the bad item otherwise. An empty string is no tuning."""
    tuning: dict[str, bool | int] = {}
    for item in (t.strip() for t in spec.split(",")):
        if not item:
            continue
        key, eq, value = (x.strip() for x in item.partition("="))
        kind = DECODE_TUNING.get(key)
        if kind is None or not eq:
            raise SettingsError(f"--decode-tuning {item!r}: expected KEY=VALUE with KEY one of "
                                f"{', '.join(DECODE_TUNING)} (e.g. lean_tiles=true,split_tokens=4096)")
        if key in tuning:
            raise SettingsError(f"--decode-tuning {key} is given twice; give each key once")
        if kind is bool:
            if value.lower() not in ("true", "false"):
                raise SettingsError(f"--decode-tuning {key}={value}: {key} takes true or false")
            tuning[key] = value.lower() == "true"
        else:
            if not value.isdigit() or int(value) < 1:
                raise SettingsError(f"--decode-tuning {key}={value}: {key} takes a positive integer")
            tuning[key] = int(value)
    return tuning


def describe_decode_tuning(tuning: dict[str, Any]) -> str:
    """``lean_tiles=true,split_tokens=4096``: :func:`parse_decode_tuning`'s input form (empty for none)."""
    return ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in tuning.items())


class SettingsError(OscarError):
    """The ``oscar`` entry of ``--json-model-override-args`` is missing or malformed."""


@dataclass(frozen=True)
class OscarSettings:
    artifact: Path
    anchors: int = DEFAULT_ANCHORS
    anchor_interval: int = DEFAULT_ANCHOR_INTERVAL
    int8_scores: bool = False
    """Decode scores over INT2 rows from int8 MMAs (each head's rotated query rounded to int8 steps of
    ``max |q'| / 127``; ``oscar_kernels.decode_int2(int8_scores=...)``): faster at large batches, off by default."""
    int8_values: bool = False
    """Decode value products over INT2 rows from int8 MMAs (each tile's probabilities times value scales in int8
    steps of 1/127 of its largest, rounded with a dither; ``oscar_kernels.decode_int2(int8_values=...)``): faster at
    large batches, off by default."""
    decode_tuning: dict[str, Any] = field(default_factory=dict)
    """Extra decode-kernel launch options (keys of :data:`DECODE_TUNING`), passed to ``DecodePlan``; empty by
    default (the kernel's measured defaults)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "artifact", Path(self.artifact))
        for name in ("anchors", "anchor_interval"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise SettingsError(f"oscar setting {name} must be a non-negative integer, got {v!r}")
        for name in ("int8_scores", "int8_values"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise SettingsError(f"oscar setting {name} must be true or false, got {v!r}")
        tuning = self.decode_tuning
        if not isinstance(tuning, dict):
            raise SettingsError(f"oscar setting decode_tuning must be an object, got {tuning!r}")
        for k, v in tuning.items():
            kind = DECODE_TUNING.get(k)
            if kind is None:
                raise SettingsError(f"unknown decode_tuning key {k!r}; allowed: {', '.join(DECODE_TUNING)}")
            if kind is bool and not isinstance(v, bool):
                raise SettingsError(f"decode_tuning {k} must be true or false, got {v!r}")
            if kind is int and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise SettingsError(f"decode_tuning {k} must be a positive integer, got {v!r}")
        object.__setattr__(self, "decode_tuning", dict(tuning))

    def to_dict(self) -> dict[str, Any]:
        return {"artifact": str(self.artifact), "anchors": self.anchors, "anchor_interval": self.anchor_interval,
                "int8_scores": self.int8_scores, "int8_values": self.int8_values,
                "decode_tuning": dict(self.decode_tuning)}

    @classmethod
    def from_dict(cls, d: Any) -> OscarSettings:
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(d, dict) or "artifact" not in d:
            raise SettingsError(f'the "{CHANNEL_KEY}" entry must be an object with at least "artifact" '
                                f"(allowed keys: {', '.join(sorted(names))})")
        unknown = sorted(set(d) - names)
        if unknown:
            raise SettingsError(f'unknown key(s) {", ".join(unknown)} in the "{CHANNEL_KEY}" entry; '
                                f"allowed: {', '.join(sorted(names))}")
        return cls(**d)


def _overrides(text: str | None) -> dict[str, Any]:
    try:
        d = json.loads(text or "{}")
    except json.JSONDecodeError as e:
        raise SettingsError(f"--json-model-override-args is not valid JSON ({e.msg})") from None
    if not isinstance(d, dict):
        raise SettingsError("--json-model-override-args must be a JSON object")
    return d


def read_settings(json_model_override_args: str | None) -> OscarSettings | None:
    """The settings carried by ``--json-model-override-args``, or None when it has no ``oscar`` entry."""
    d = _overrides(json_model_override_args)
    return None if CHANNEL_KEY not in d else OscarSettings.from_dict(d[CHANNEL_KEY])


def write_settings(settings: OscarSettings, json_model_override_args: str | None = None) -> str:
    """``--json-model-override-args`` carrying ``settings``, merged into existing overrides (which must not carry an
    ``oscar`` entry already)."""
    d = _overrides(json_model_override_args)
    if CHANNEL_KEY in d:
        raise SettingsError(f'--json-model-override-args already has an "{CHANNEL_KEY}" entry; pass the artifact '
                            "once, through `oscar serve --artifact`")
    d[CHANNEL_KEY] = settings.to_dict()
    return json.dumps(d, sort_keys=True)
