"""Serving test helpers: a word-model folder, a server in a background thread, an engine loader."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from helpers import WordKit

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}w0{% endif %}")
"""A chat template over the word vocabulary: roles are unknown words (<unk>), contents are words, w0 opens the reply."""


def save_wordkit(folder: Path, seed: int = 0) -> Path:
    tok = WordKit.tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    model = WordKit.llama(seed=seed)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``create_app(engine, config)`` under the server ``oscar serve`` runs (:func:`draining_server`: in-flight
    requests get ``grace_s`` to finish at shutdown) in a background thread on a free port."""

    def __init__(self, engine, grace_s: float = 2.0, **config):
        from oscar_cli.serve.config import ServeConfig
        from oscar_cli.serve.openai_server import create_app, draining_server

        self.engine = engine
        self.config = ServeConfig(port=free_port(), shutdown_timeout_s=grace_s, **config)
        self.app = create_app(engine, self.config)
        self.server = draining_server(self.app, engine, self.config, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        self.base = f"http://127.0.0.1:{self.config.port}"
        self.url = self.base + "/v1"

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()


def load_engine(model: Path, store: Path, artifact: Path | None = None, max_queue: int | None = None):
    from oscar_cli.serve.engine import TransformersEngine

    return TransformersEngine.load(str(model), store, artifact, max_queue=max_queue)


def wait_until(pred, timeout: float = 20.0, step: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(step)
