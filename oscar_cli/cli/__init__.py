"""``oscar`` command line: one module per command, registered on the shared app."""

from . import bench, collect, eval, fit, inspect, runs, serve, share  # noqa: F401  (register commands)
from ._app import app


def main() -> None:
    app()
