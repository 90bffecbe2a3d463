"""The lm-eval model ``oscar``: an ``HFLM`` whose KV cache is a method of :mod:`oscar_cli.methods`.

Loglikelihoods go through the decode-equivalent attention (:func:`oscar_cli.prepare.prepare`), ``generate`` through a
fresh cache per call. The class is built and registered on first use (:func:`oscar_lm_class`, or the module
attribute ``OscarLM`` that the ``lm_eval.models`` entry point names), so importing this module stays cheap: lm-eval's
``HFLM`` is slow to import.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import QuantScheme
from ..methods import Method, get_method, scheme_for

ENTRY_POINT = f"{__name__}:OscarLM"
"""The ``lm_eval.models`` entry point of the model (``pyproject.toml``; :mod:`oscar_cli.serve.lm_eval_plugin`)."""


def _make_oscar_lm_class():
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM

    from ..cache import cache_kwarg, make_cache
    from ..prepare import head_dim_of, prepare

    @register_model("oscar")
    class OscarLM(HFLM):
        """lm-eval model ``oscar``: an HF causal LM whose KV cache is a method of :mod:`oscar_cli.methods`.

        Arguments (``--model_args``): ``pretrained`` (a loaded model or a model spec for
        :func:`oscar_cli.models.load_model`), ``method``, ``artifact`` (a path or a loaded artifact), the scheme
        overrides ``sink``, ``recent``, ``group``, ``bits`` (default: the artifact's scheme, or
        :class:`QuantScheme`'s for data-free methods; ``reference`` sets the data-free methods' sink/recent),
        ``store``, plus any ``HFLM`` argument."""

        def __init__(self, pretrained="smollm2-135m", method: str | Method = "bf16", artifact=None,
                     sink: int | None = None, recent: int | None = None, group: int | None = None,
                     bits: int | None = None, reference: QuantScheme | None = None, store: str = ".oscar",
                     tokenizer=None, **kwargs):
            if isinstance(pretrained, str):
                from ..models import load_model

                loaded = load_model(pretrained, Path(store))
                pretrained, tokenizer = loaded.model, loaded.tokenizer
            if isinstance(artifact, (str, Path)):
                from ..artifact import load_artifact

                artifact = load_artifact(Path(artifact))
            method = get_method(method) if isinstance(method, str) else method
            overrides = {k: int(v) for k, v in dict(sink=sink, recent=recent, group=group, bits=bits).items()
                         if v is not None}
            scheme = scheme_for(method, head_dim_of(pretrained.config),
                                artifact_scheme=artifact.scheme if artifact is not None else None,
                                reference=reference, overrides=overrides,
                                artifact_name=artifact.name if artifact is not None else "")
            kwargs.setdefault("device", str(next(pretrained.parameters()).device))
            super().__init__(pretrained=pretrained, tokenizer=tokenizer, **kwargs)
            self.prep = prepare(self.model, method, scheme, artifact)

        def _model_generate(self, context, max_length, stop, **generation_kwargs):
            if self.prep.method.family != "exact":
                cache = make_cache(self.model, self.prep.method, self.prep.quants, self.prep.scheme)
                generation_kwargs[cache_kwarg(self.model)] = cache
                pad = self.tokenizer.pad_token_id
                if pad is not None and "attention_mask" not in generation_kwargs:
                    mask = (context != pad).long()
                    # a row that starts with the pad id as a real token (pad == eos) keeps its first token
                    mask[:, -1] = 1
                    generation_kwargs["attention_mask"] = torch.cumsum(mask, 1).clamp(max=1)
            return super()._model_generate(context, max_length, stop, **generation_kwargs)

    return OscarLM


_OSCAR_LM = None


def __getattr__(name: str):
    """``oscar_cli.eval.lm_eval_model.OscarLM`` (the entry point lm-eval resolves) builds the class on first use."""
    if name == "OscarLM":
        return oscar_lm_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def oscar_lm_class():
    """The registered lm-eval model class (registered on first use, so importing this module stays cheap)."""
    global _OSCAR_LM
    if _OSCAR_LM is None:
        _OSCAR_LM = _make_oscar_lm_class()
    return _OSCAR_LM
