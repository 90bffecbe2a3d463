"""lm-eval tasks shipped with OSCAR-KV (yaml + python in this folder; loaded with
``TaskManager(include_path=<this folder>, include_defaults=False)``)."""

TOKENIZERS: dict[str, object] = {}
"""name -> loaded tokenizer: the task modules (imported by lm-eval from their file paths) look tokenizers up here
before loading one by name."""
