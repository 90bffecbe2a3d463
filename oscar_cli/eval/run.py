"""The entry point of ``oscar eval``: :func:`run_eval`, an :class:`~oscar_cli.config.EvalConfig` in, an
:class:`~.report.EvalResult` out.

It resolves artifacts (``latest``, ``vN``, a path, ``fit:ROTATION[+per-head]``), decides every method's
:class:`~oscar_kernels.scheme.QuantScheme` (an artifact's own; data-free baselines take the artifact's sink/recent
so that the table compares like with like; explicit overrides on top, refused where they cannot hold) and runs the
method loop: perplexity segments (:mod:`.perplexity`) and lm-eval tasks (:mod:`.lm_eval_tasks`) per method, the rows
stored as each method finishes. With ``cfg.server`` the tasks run against that server instead (:mod:`.remote`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..artifact import ArtifactError, load_artifact, read_manifest
from ..config import PPL_TASK, EvalConfig, QuantScheme, expand_tasks
from ..methods import parse_methods, scheme_for, scheme_record
from ..models import load_model
from ..prepare import element_bits, head_dim_of, prepare
from ..progress import Progress
from ..store import Store
from ..tasks import TOKENIZERS
from . import EvalError
from .lm_eval_model import oscar_lm_class
from .lm_eval_tasks import check_lm_tasks, lm_eval_version, lm_rows, lm_task_names, run_lm_eval
from .perplexity import perplexity
from .remote import run_eval_server
from .report import EvalResult, EvalRow, check_thresholds
from .segments import ppl_steps, ppl_text, segments_of, segments_per_length


def resolve_artifact_ref(store: Store, ref: str, slug: str) -> Path:
    """``fit:ROTATION[+per-head]`` -> the newest artifact fitted with that rotation recipe; anything else -> the
    store's resolver (``latest``, ``vN``, ``model/vN``, an id, a folder)."""
    if not ref.startswith("fit:"):
        return store.resolve_artifact(ref, slug)
    want, _, flag = ref[4:].partition("+")
    if flag not in ("", "per-head"):
        raise EvalError(f"artifact ref {ref!r}: use fit:ROTATION or fit:ROTATION+per-head")
    per_head = flag == "per-head"
    for a in reversed(store.list_artifacts(slug)):
        if a["method"] != want:
            continue
        try:
            manifest = read_manifest(Path(a["path"]))
        except ArtifactError:
            continue
        if manifest.per_head == per_head:
            return Path(a["path"])
    raise EvalError(f"no artifact fitted with rotation {want}{' per head' if per_head else ''} for {slug}; "
                    f"run: oscar fit --method {want}{' --per-head' if per_head else ''}")


def reference_scheme(artifacts: dict, overrides: dict[str, int]) -> QuantScheme:
    """The scheme whose sink/recent data-free methods run with: the artifacts' (when they agree), else the defaults;
    an explicit override wins (it applies to every method)."""
    kept = {(a.scheme.sink, a.scheme.recent): a.name for a in artifacts.values()}
    if len(kept) > 1 and not {"sink", "recent"} <= set(overrides):
        shown = ", ".join(f"{n} ({s}/{r})" for (s, r), n in kept.items())
        raise EvalError(f"the artifacts keep different sink/recent rows exact: {shown}; pass --sink and --recent to "
                        "compare them (and the data-free baselines) at one setting")
    if len(kept) == 1:
        (sink, recent), = kept
        return QuantScheme(sink=sink, recent=recent)
    return QuantScheme()


def run_eval(cfg: EvalConfig, store: Path, progress: Progress | None = None) -> EvalResult:
    """Evaluate every method of ``cfg`` on its tasks; rows go to the store's ``evals`` table as each method finishes
    (an interrupted run keeps every finished method). Returns the rows and the threshold misses. With
    ``cfg.server`` the tasks run against that server instead (:func:`~.remote.run_eval_server`)."""
    if cfg.server:
        return run_eval_server(cfg, store, progress)
    progress = progress or Progress()
    methods = parse_methods(cfg.methods)
    row_tasks = expand_tasks(cfg.tasks)
    lm_tasks = lm_task_names([t for t in row_tasks if t != PPL_TASK])
    if cfg.data is not None and not Path(cfg.data).is_file():
        raise EvalError(f"--data {cfg.data} is not a file; pass a UTF-8 text file")
    if any(m.cache_only for m in methods) and PPL_TASK in row_tasks and max(cfg.seq_lengths) > 2048:
        raise EvalError("hf-* peers decode token by token for oscar_ppl; use --seq-lengths of at most 2048")
    check_lm_tasks(lm_tasks)  # before the model loads

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    st = Store(store)  # refuses a damaged store before the model loads
    loaded = load_model(cfg.model, store, dtype=dtype, device=device)
    head_dim = head_dim_of(loaded.config)
    artifacts = {}
    for m in methods:
        ref = m.arg or cfg.artifact
        if m.needs_artifact and ref not in artifacts:
            artifacts[ref] = load_artifact(resolve_artifact_ref(st, ref, loaded.slug), loaded.fingerprint)
    overrides = cfg.overrides
    reference = reference_scheme(artifacts, overrides)
    plan = []  # every method's scheme first, so a refused override stops the run before any work
    for m in methods:
        art = artifacts.get(m.arg or cfg.artifact) if m.needs_artifact else None
        scheme = scheme_for(m, head_dim, artifact_scheme=art.scheme if art else None, reference=reference,
                            overrides=overrides, artifact_name=art.name if art else "")
        plan.append((m, art, scheme))
    text_ids = ppl_text(cfg, loaded.tokenizer)
    version = lm_eval_version()
    progress.start(len(methods) * (ppl_steps(cfg, text_ids) + (1 if lm_tasks else 0)))
    result = EvalResult()
    for m, art, scheme in plan:
        rows: list[EvalRow] = []
        prep = prepare(loaded.model, m, scheme, art)
        base = dict(model_fingerprint=loaded.fingerprint, model_slug=loaded.slug, method=m.label,
                    artifact=prep.artifact, lm_eval_version=version)
        run_cfg = dict(limit=cfg.limit, device=device, dtype=str(dtype).removeprefix("torch."), bits=scheme.bits,
                       **scheme_record(scheme, overrides))
        if text_ids is not None:
            for n in cfg.seq_lengths:
                progress.describe(f"{m.label} {PPL_TASK}@{n}")
                segs = segments_of(text_ids, n, segments_per_length(cfg))
                ppl = perplexity(loaded.model, segs, prep, progress.advance, decode=cfg.decode)
                rows.append(EvalRow(**base, task=PPL_TASK, metric="ppl", value=ppl,
                                    config=dict(run_cfg, seq_len=n, segments=len(segs),
                                                mode="decode" if cfg.decode or m.cache_only else "teacher-forced",
                                                data=str(cfg.data) if cfg.data else "builtin:heldout"),
                                    bits_per_element=element_bits(prep, loaded.model, n)))
        if lm_tasks:
            progress.describe(f"{m.label} {','.join(lm_tasks)}")
            tok_name = getattr(loaded.tokenizer, "name_or_path", None) or loaded.slug
            TOKENIZERS[tok_name] = loaded.tokenizer
            lm = oscar_lm_class()(pretrained=loaded.model, tokenizer=loaded.tokenizer, method=m, artifact=art,
                                  reference=reference, batch_size=1, max_length=max(cfg.seq_lengths) + 256,
                                  **overrides)
            res = run_lm_eval(lm, lm_tasks, cfg.limit, {"tokenizer": tok_name, "max_seq_lengths": list(cfg.seq_lengths)})
            rows += lm_rows(res, base, run_cfg, cfg.seq_lengths,
                            lambda n, prep=prep: element_bits(prep, loaded.model, n))
            progress.advance()
        st.record_evals([r.to_dict() for r in rows])  # per method: an interrupted run keeps every finished method
        result.rows.extend(rows)
    result.misses = check_thresholds(result.rows, cfg.thresholds)
    return result
