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
* ``decode``: the decode kernel's options (:class:`oscar_kernels.scheme.DecodeOptions` in its JSON form: only the
  keys that differ from the defaults, e.g. ``{"int8_scores": true, "split_tokens": 4096}``), passed unchanged to
  ``DecodePlan(options=...)``.

Pure Python: no torch, no SGLang.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oscar_kernels.scheme import DecodeOptions, DecodeOptionsError

from ...errors import OscarError

CHANNEL_KEY = "oscar"
"""Key of the plugin's entry in ``--json-model-override-args``."""
DEFAULT_ANCHORS = 64
"""Anchor entries. Each costs ``(sink + recent) * layers * kv_heads * head_dim * 4`` bytes (K and V, bf16): 47 MiB
for Qwen3-8B shapes at sink 64 / recent 256 (3 GiB for 64), 0.3 MiB for SmolLM2-135M at 16 / 64."""
DEFAULT_ANCHOR_INTERVAL = 1024
"""Anchors inside a long extend: a prompt sharing the first ``k * 1024`` tokens with a cached one reuses them even
when the cached prompt went on (a shared 2k-token system prompt followed by different questions)."""


class SettingsError(OscarError):
    """The ``oscar`` entry of ``--json-model-override-args`` is missing or malformed."""


@dataclass(frozen=True)
class OscarSettings:
    artifact: Path
    anchors: int = DEFAULT_ANCHORS
    anchor_interval: int = DEFAULT_ANCHOR_INTERVAL
    decode: DecodeOptions = DecodeOptions()
    """How the decode kernel runs (``oscar serve --int8-scores --int8-values --decode-tuning``); the defaults are
    the exact path at the kernel's measured launch settings."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "artifact", Path(self.artifact))
        for name in ("anchors", "anchor_interval"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise SettingsError(f"oscar setting {name} must be a non-negative integer, got {v!r}")
        if not isinstance(self.decode, DecodeOptions):
            raise SettingsError(f"oscar setting decode must be DecodeOptions, got {self.decode!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"artifact": str(self.artifact), "anchors": self.anchors, "anchor_interval": self.anchor_interval,
                "decode": self.decode.to_dict()}

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
        if "decode" in d:
            try:
                d = {**d, "decode": DecodeOptions.from_dict(d["decode"], where=f'"decode" of the "{CHANNEL_KEY}" entry')}
            except DecodeOptionsError as e:
                raise SettingsError(str(e)) from None
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
