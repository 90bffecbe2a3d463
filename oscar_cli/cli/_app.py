"""The Typer app, shared option aliases and the error boundary.

A command parses, builds a config, calls the library and renders; heavy imports happen inside commands.
Errors the user can fix (:class:`oscar_cli.errors.OscarError`) print one line and exit 1; ``OSCAR_DEBUG=1`` shows
the traceback. Usage errors exit 2 (Typer's default; :func:`fail` with ``code=2`` for those found after parsing).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from oscar_kernels.scheme import DecodeOptions, DecodeOptionsError
from rich.console import Console

from ..config import DEFAULT_ARTIFACTS, DEFAULT_MODEL, DEFAULT_STORE, SchemeError
from ..errors import OscarError

app = typer.Typer(
    name="oscar",
    help="OSCAR-KV: calibrate, fit, inspect and evaluate INT2 KV-cache rotations.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)
out = Console()

ModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help=f"Hub id, local model folder, local .gguf file, or the embedded default '{DEFAULT_MODEL}'.",
    ),
]
StoreOpt = Annotated[Path, typer.Option("--store", help="Store folder (DuckDB database and converted models).")]
ArtifactsOpt = Annotated[Path, typer.Option("--artifacts", help="Folder that holds artifacts/<model>/v<N>/.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]
DecodeTuningOpt = Annotated[str, typer.Option("--decode-tuning", help="Decode-kernel options of the SGLang engine, "
                                              f"KEY=VALUE[,KEY=VALUE...] with KEY among {', '.join(DecodeOptions.names())}"
                                              " (true/false for switches, integers for counts); default: the exact "
                                              "path at the kernel's measured launch settings.")]
RecipeOpt = Annotated[Path | None, typer.Option("--recipe", help="Recipe YAML (recipes/<model>.yaml); flags override it.")]

DEFAULTS = {"model": DEFAULT_MODEL, "store": DEFAULT_STORE, "artifacts": DEFAULT_ARTIFACTS}


def fail(message: str, code: int = 1) -> typer.Exit:
    console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def decode_options(tuning: str, int8_scores: bool = False, int8_values: bool = False) -> DecodeOptions:
    """The decode kernel's options, built once from the command line: ``--decode-tuning``'s items over the int8
    switches. A bad item is a usage error: one line, exit 2."""
    try:
        return DecodeOptions.parse(tuning, base=DecodeOptions(int8_scores=int8_scores, int8_values=int8_values))
    except DecodeOptionsError as e:
        raise fail(str(e), code=2) from None


def torch_device(name: str) -> str:
    """``--device`` checked before anything slow: a torch device string this machine has, else a one-line
    :class:`~oscar_cli.errors.OscarError` naming the fix."""
    import torch

    from ..errors import OscarError

    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise OscarError(f"--device {name!r} is not a torch device; use cpu or cuda (cuda:N for another GPU)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise OscarError(f"--device {name}: no CUDA device is visible to torch {torch.__version__} on this machine; "
                             "use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise OscarError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s); use "
                             f"cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    elif dev.type != "cpu":
        raise OscarError(f"--device {name}: collect runs on cpu or cuda; use one of them")
    return name


def guarded(fn=None, *, interrupted: str = "interrupted; nothing was written"):
    """Turn OscarError (and scheme errors) into a one-line message and exit 1; Ctrl-C prints ``interrupted`` (what
    the command kept) and exits 130. Use as ``@guarded`` or ``@guarded(interrupted="...")``."""
    if fn is None:
        return functools.partial(guarded, interrupted=interrupted)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except (OscarError, SchemeError) as e:
            if os.environ.get("OSCAR_DEBUG") == "1":
                raise
            raise fail(str(e)) from None
        except KeyboardInterrupt:
            console.print(interrupted)
            sys.exit(130)

    return wrapper
