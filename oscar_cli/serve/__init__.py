"""Serving: an OpenAI-compatible HTTP server over a KV-cache method (``oscar serve``).

* :mod:`.config`: :class:`ServeConfig`, every serving default in one place;
* :mod:`.engine`: :class:`TransformersEngine`, one worker thread that decodes token by token through a fresh
  :class:`oscar_cli.cache.OscarCache` per request (:func:`.engine.kv_setup` is its one call into the cache and
  model-state APIs);
* :mod:`.openai_server`: :func:`create_app`, the FastAPI app (``/v1/models``, ``/v1/completions``,
  ``/v1/chat/completions``, ``/health``, ``/metrics``), with :mod:`.metrics` (Prometheus text);
* :mod:`.lm_eval_plugin`: the startup hook that lets lm-eval's own CLI find the model ``oscar``;
* ``sglang/``: the SGLang engine.

Importing this package is cheap (no torch, no FastAPI): the lm-eval startup hook imports it in every interpreter.
"""
