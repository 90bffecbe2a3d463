"""Serving configuration: every default of the server and the engine, written once."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import OscarError


class ServeConfigError(OscarError):
    """A serving option out of range; the message names the option."""


@dataclass(frozen=True)
class ServeConfig:
    """How ``oscar serve`` listens and what it accepts.

    * ``host``/``port``: where the HTTP server listens.
    * ``model_id``: the id clients put in ``"model"`` (None: the model's slug, e.g. ``smollm2-135m``).
    * ``max_queue``: requests waiting for the engine's worker besides the one it decodes; one more is refused
      with 429.
    * ``max_context``: prompt + completion tokens per request (None: the model's ``max_position_embeddings``).
    * ``default_max_tokens``: completion tokens when a request gives no ``max_tokens`` (cut to what the context
      leaves).
    * ``max_logprobs``: the most alternatives a request may ask for (``logprobs`` / ``top_logprobs``).
    * ``shutdown_timeout_s``: on SIGINT/SIGTERM, how long in-flight requests may run before they are cancelled.
    * ``disconnect_poll_s``: how often a non-streaming request checks whether its client went away.
    * ``max_body_bytes``: the largest request body accepted; a larger one is answered 413 before it is read whole
      (a long-context prompt of 100k tokens is ~0.5 MB of text or ~0.7 MB of token ids).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    model_id: str | None = None
    max_queue: int = 16
    max_context: int | None = None
    default_max_tokens: int = 256
    max_logprobs: int = 20
    shutdown_timeout_s: float = 10.0
    disconnect_poll_s: float = 0.25
    max_body_bytes: int = 8 << 20

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ServeConfigError(f"--port must be in 0..65535, got {self.port}")
        if self.max_queue < 0:
            raise ServeConfigError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.max_context is not None and self.max_context < 2:
            raise ServeConfigError(f"--max-context must be at least 2 tokens, got {self.max_context}")
        if self.default_max_tokens < 1 or self.max_logprobs < 0:
            raise ServeConfigError("default_max_tokens must be >= 1 and max_logprobs >= 0")
        if self.shutdown_timeout_s < 0 or self.disconnect_poll_s <= 0:
            raise ServeConfigError("shutdown_timeout_s must be >= 0 and disconnect_poll_s > 0")
        if self.max_body_bytes < 1024:
            raise ServeConfigError(f"--max-body-bytes must be at least 1024, got {self.max_body_bytes}")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"
