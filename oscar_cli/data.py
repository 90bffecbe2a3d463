"""Calibration and evaluation text.

``--data`` accepts

* ``builtin:pydoc``: the standard library's ``pydoc_data.topics`` (79 topics, ~465k characters), topics in sorted
  order joined by blank lines. The first ``CALIBRATION_FRACTION`` of the characters (cut at a topic boundary) is the
  calibration part; the rest is held out for evaluation (:func:`heldout_text`), so perplexity is never measured on
  text the rotations were fitted on.
* ``PATH.txt``: one document (the whole file).
* ``PATH.jsonl``: one document per line, either a JSON string or an object with a ``"text"`` field.

Documents are tokenized, joined with the tokenizer's EOS token, and cut into ``seq_len`` segments in order; a
calibration run uses the first ``ceil(tokens / seq_len)`` segments, so the same data, tokenizer and settings always
give the same batches (which is what makes ``--resume`` exact).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from .errors import OscarError

BUILTIN = "builtin:pydoc"
CALIBRATION_FRACTION = 0.6


class DataError(OscarError):
    pass


def _pydoc_topics() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def _split_builtin() -> tuple[str, str]:
    docs = _pydoc_topics()
    total = sum(len(d) for d in docs)
    acc, cut = 0, len(docs)
    for i, d in enumerate(docs):
        if acc >= CALIBRATION_FRACTION * total:
            cut = i
            break
        acc += len(d)
    return "\n\n".join(docs[:cut]), "\n\n".join(docs[cut:])


def calibration_text_builtin() -> str:
    return _split_builtin()[0]


def heldout_text() -> str:
    """The built-in held-out evaluation text (the part of ``pydoc_data.topics`` that calibration never sees)."""
    return _split_builtin()[1]


def read_text_file(path: str | Path) -> str:
    """Read a UTF-8 text file; raise :class:`DataError` if it is missing, unreadable or empty."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"data file {p} does not exist; pass an existing .txt/.jsonl file or '{BUILTIN}'") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read data file {p} ({e.__class__.__name__}); pass a UTF-8 text file") from None
    if not text.strip():
        raise DataError(f"data file {p} is empty; pass a file with text in it")
    return text


def load_documents(spec: str) -> list[str]:
    """Documents named by ``--data`` (see module docstring)."""
    if spec == BUILTIN:
        return [calibration_text_builtin()]
    if spec.startswith("builtin:"):
        raise DataError(f"unknown built-in data {spec!r}; the built-in corpus is '{BUILTIN}'")
    text = read_text_file(spec)
    if not spec.endswith(".jsonl"):
        return [text]
    docs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{spec}:{n} is not valid JSON ({e.msg}); each line must be a string or {{\"text\": ...}}") from None
        doc = obj if isinstance(obj, str) else obj.get("text") if isinstance(obj, dict) else None
        if not isinstance(doc, str):
            raise DataError(f"{spec}:{n} has no \"text\" string; each line must be a string or {{\"text\": ...}}")
        if doc.strip():
            docs.append(doc)
    if not docs:
        raise DataError(f"{spec} holds no non-empty documents")
    return docs


def token_segments(tokenizer, docs: list[str], seq_len: int, n_segments: int) -> torch.Tensor:
    """Tokenize and cut into ``n_segments`` segments of ``seq_len`` tokens: int64 ``[n_segments, seq_len]``."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    need = seq_len * n_segments
    for d in docs:
        ids.extend(tokenizer(d, add_special_tokens=False)["input_ids"])
        if eos is not None:
            ids.append(eos)
        if len(ids) >= need:
            break
    if len(ids) < need:
        have = len(ids) // seq_len * seq_len
        raise DataError(
            f"the data holds {len(ids)} tokens, fewer than the {need} asked for; "
            f"lower --tokens to at most {have} or give more text"
        )
    return torch.tensor(ids[:need], dtype=torch.int64).view(n_segments, seq_len)


def digest(segments: torch.Tensor) -> str:
    """sha256 of the token ids actually used (captures text, tokenizer and segmenting)."""
    return "sha256:" + hashlib.sha256(segments.numpy().tobytes()).hexdigest()[:32]
