"""The SGLang server command for an OSCAR artifact: argv and the environment to add (``oscar serve --engine sglang``).

:func:`build_launch` refuses, with one line, extra arguments that conflict with the plugin (another attention or
radix-cache backend, the settings channel given twice, and every server flag :mod:`.refusals` refuses), so the CLI
fails before SGLang spends a minute importing. It imports neither SGLang nor torch's CUDA: it runs wherever ``oscar``
does.
"""

from __future__ import annotations

import sys
from pathlib import Path

from oscar_kernels.scheme import DecodeOptions

from .refusals import BACKEND, ServeRefusal, server_args_refusals
from .settings import OscarSettings, write_settings

PLUGIN_ENV = "SGLANG_PLUGINS"
"""SGLang's plugin whitelist (comma-separated entry-point names)."""
PLUGIN_NAME = "oscar"
"""The entry point in ``[project.entry-points."sglang.srt.plugins"]``."""
DEFAULT_MAX_RUNNING_REQUESTS = 64
"""Request slots, each with an exact region (see :mod:`.sizing`): passed unless ``extra`` sets
``--max-running-requests``."""

_OWNED = {"--attention-backend": BACKEND, "--radix-cache-backend": BACKEND}
_BOOLEAN = {
    "--enable-hierarchical-cache", "--enable-lmcache", "--enable-flexkv", "--enable-mixed-chunk",
    "--enable-dp-attention", "--enable-two-batch-overlap", "--enable-pdmux", "--enable-streaming-session",
    "--disable-radix-cache", "--disable-overlap-schedule",
}


def _flags(extra: list[str]) -> dict[str, str | bool]:
    """``--flag value`` / ``--flag=value`` / boolean ``--flag`` of ``extra`` (last one wins)."""
    out: dict[str, str | bool] = {}
    i = 0
    while i < len(extra):
        tok = extra[i]
        if tok.startswith("--"):
            name, eq, value = tok.partition("=")
            if eq:
                out[name] = value
            elif name in _BOOLEAN or i + 1 >= len(extra) or extra[i + 1].startswith("--"):
                out[name] = True
            else:
                out[name] = extra[i + 1]
                i += 1
        i += 1
    return out


def _without(extra: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for i, tok in enumerate(extra):
        if skip:
            skip = False
            continue
        if tok == flag:
            skip = i + 1 < len(extra) and not extra[i + 1].startswith("--")
            continue
        if tok.startswith(flag + "="):
            continue
        out.append(tok)
    return out


def build_launch(model_path: str, artifact: Path, host: str, port: int, extra: list[str],
                 decode: DecodeOptions = DecodeOptions()) -> tuple[list[str], dict[str, str]]:
    """``(argv, env)`` starting SGLang's HTTP server on ``model_path`` with the OSCAR backend and ``artifact``.

    ``argv`` is ``python -m sglang.launch_server --model-path ... --attention-backend oscar --radix-cache-backend
    oscar --json-model-override-args '{"oscar": {...}}' ...`` followed by ``extra`` (user flags, passed through);
    ``env`` holds what to add to the environment (``SGLANG_PLUGINS=oscar``). ``decode`` (the decode kernel's options)
    goes into the settings as :attr:`~.settings.OscarSettings.decode`. Raises
    :class:`~.refusals.ServeRefusal` (one line) for extra flags that conflict with the plugin."""
    flags = _flags(extra)
    problems = []
    for flag, want in _OWNED.items():
        if flag in flags and flags[flag] != want:
            problems.append(f"{flag} {flags[flag]} conflicts with the OSCAR engine, which sets {flag} {want}; "
                            "drop it from the extra arguments")
    for flag in ("--model-path", "--model", "--host", "--port"):
        if flag in flags:
            problems.append(f"{flag} is set by `oscar serve` itself; drop it from the extra arguments")
    fields = {k[2:].replace("-", "_"): v for k, v in flags.items() if k not in _OWNED}
    fields.setdefault("max_running_requests", DEFAULT_MAX_RUNNING_REQUESTS)
    fields["radix_cache_backend"] = BACKEND
    problems += server_args_refusals(fields, environ={})
    if problems:
        raise ServeRefusal(f"oscar: {problems[0]}")
    settings = OscarSettings(artifact=Path(artifact).resolve(), decode=decode)
    user_overrides = flags.get("--json-model-override-args")
    overrides = write_settings(settings, user_overrides if isinstance(user_overrides, str) else None)
    rest = _without(extra, "--json-model-override-args")
    for flag in _OWNED:
        rest = _without(rest, flag)
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path), "--host", host,
            "--port", str(port), "--attention-backend", BACKEND, "--radix-cache-backend", BACKEND,
            "--json-model-override-args", overrides]
    if "--max-running-requests" not in flags:
        argv += ["--max-running-requests", str(DEFAULT_MAX_RUNNING_REQUESTS)]
    return argv + rest, {PLUGIN_ENV: PLUGIN_NAME}
