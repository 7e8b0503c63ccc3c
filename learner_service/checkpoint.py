"""Checkpoint and resume: weights, optimiser, scheduler, RNG, policy version, trained groups.

Layout: ``<run_dir>/checkpoints/step_<N:08d>/`` (a later checkpoint of the same step:
``step_<N:08d>_r<k>``) with ``dcp/`` (model and optimiser state written with
``torch.distributed.checkpoint``: each rank writes its own shard, ``__<rank>_0.distcp``, and
rank 0 the ``.metadata``), ``extra.json`` (scheduler, shuffle generator, the RNG states of
every rank) and ``state.json`` (step, policy version, trained group ids — the record that
makes training exactly-once), plus ``<run_dir>/checkpoints/latest`` naming the newest one.
No rank ever holds the full state dicts: what a rank writes is its FSDP shard, so the
memory a checkpoint needs does not grow with the number of ranks (gpt-oss-20b and its AdamW
state on 6 ranks). Loading reshards: a checkpoint written by W ranks loads on W' ranks.
Published policy versions (learner_service/publish.py) are still full transformers folders
loadable with ``from_pretrained``.

Nothing is unpickled that could run code: the shards load with ``weights_only=True``; DCP's
``.metadata`` is read by a restricted unpickler that admits only DCP's own metadata classes,
torch dtypes and sizes and plain containers (`_SafeReader`); the extra state is JSON
(`extra_to_json`). A checkpoint of an older version (``model.pt``, ``optim.pt``: full state
dicts, and maybe ``extra.pt``) still loads, with ``weights_only=True``; one that does not
load that way is refused, naming the file.

Durability and crashes: every checkpoint goes to a new folder — the ranks write into
``.tmp-<name>``, every file is fsynced, rank 0 renames the folder into place and fsyncs the
parent, and only then switches ``latest`` (tmp + rename + fsync). An existing checkpoint
folder is never modified or deleted before ``latest`` names a newer one, so a SIGKILL at any
moment leaves ``latest`` naming a complete checkpoint. Resume reads ``latest``; should it
name a folder that is missing or incomplete (a disk that lost it), it falls back to the
newest complete checkpoint with a warning. A checkpoint asked for when nothing changed since
the last one (same state: step, policy version, trained ids, counters) writes nothing and
returns the last one. The learner acknowledges groups in the buffer only after
`save_checkpoint` has returned.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from learner_service.trainer import Learner, LearnerState

log = logging.getLogger(__name__)

LATEST = "latest"


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


#: The extra state's file (JSON) and the older pickle it replaces (read with weights_only=True).
EXTRA_JSON = "extra.json"
EXTRA_PT = "extra.pt"


def _to_json(value):
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return {"__tensor__": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                "b64": base64.b64encode(data).decode("ascii")}
    if isinstance(value, tuple):
        return {"__tuple__": [_to_json(v) for v in value]}
    if isinstance(value, list):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            return {"__dict__": [[_to_json(k), _to_json(v)] for k, v in value.items()]}
        return {k: _to_json(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"checkpoint extra state: cannot store a {type(value).__name__} as JSON")


def _from_json(value):
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if isinstance(value, dict):
        if "__tensor__" in value:
            dtype = getattr(torch, value["__tensor__"])
            data = bytearray(base64.b64decode(value["b64"]))
            flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
            return flat.reshape(value["shape"]).clone()
        if "__tuple__" in value:
            return tuple(_from_json(v) for v in value["__tuple__"])
        if "__dict__" in value:
            return {_from_json(k): _from_json(v) for k, v in value["__dict__"]}
        return {k: _from_json(v) for k, v in value.items()}
    return value


def extra_to_json(extra: dict) -> str:
    """The checkpoint's extra state (scheduler, generator and RNG states) as JSON text, exactly
    restorable by `extra_from_json` (tensors: dtype, shape, base64 bytes; tuples tagged)."""
    return json.dumps(_to_json(extra))


def extra_from_json(text: str) -> dict:
    """The inverse of `extra_to_json`."""
    return _from_json(json.loads(text))


def load_extra(path: Path) -> dict:
    """The extra state of the checkpoint at `path`: ``extra.json``, else an older ``extra.pt``
    loaded with ``weights_only=True`` (never unpickling arbitrary objects).

    Raises:
        FileNotFoundError: neither file is there.
        ValueError: ``extra.pt`` holds something ``weights_only`` refuses (the file is named).
    """
    if (path / EXTRA_JSON).is_file():
        return extra_from_json((path / EXTRA_JSON).read_text())
    old = path / EXTRA_PT
    if not old.is_file():
        raise FileNotFoundError(f"{path}: no {EXTRA_JSON} (nor an older {EXTRA_PT}): incomplete checkpoint")
    try:
        return torch.load(old, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch's UnpicklingError and friends
        raise ValueError(f"{old}: refused: it does not load with weights_only=True (only tensors and plain "
                         f"containers are read from a checkpoint; nothing is unpickled): {err}") from None


def _barrier(learner: Learner) -> None:
    if learner.world > 1:
        dist.barrier()


def full_model_state_dict(learner: Learner) -> dict[str, torch.Tensor]:
    """The full (unsharded) model state dict on CPU, on rank 0 ({} on other ranks). Collective."""
    return get_model_state_dict(learner.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


#: The DCP folder inside a checkpoint.
DCP_DIR = "dcp"
_NAME = re.compile(r"^step_(\d{8})(?:_r(\d+))?$")


def _order(path: Path) -> tuple[int, int]:
    m = _NAME.match(path.name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else (-1, -1)


def _complete(path: Path) -> bool:
    """A checkpoint folder with everything a resume reads."""
    if not (path / "state.json").is_file():
        return False
    weights = (path / DCP_DIR / ".metadata").is_file() or (path / "model.pt").is_file()
    return weights and ((path / EXTRA_JSON).is_file() or (path / EXTRA_PT).is_file())


def _state_json(learner: Learner) -> str:
    return json.dumps(learner.state.__dict__, indent=1)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` admitting only its own classes, torch dtypes/sizes, containers."""

    _MODULES = ("torch.distributed.checkpoint.",)
    _GLOBALS = {("torch", "Size"), ("torch", "dtype"), ("collections", "OrderedDict"), ("builtins", "set"),
                ("builtins", "frozenset"), ("builtins", "slice"),
                ("torch", "device"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                ("pathlib", "PurePosixPath")}

    def find_class(self, module: str, name: str):
        if module.startswith(self._MODULES) or (module, name) in self._GLOBALS or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}: refused (only DCP metadata, "
                                     "torch dtypes and sizes are read from a checkpoint; nothing else is unpickled)")


class _SafeReader(FileSystemReader):
    """DCP's file reader with `_MetadataUnpickler` for ``.metadata`` (shards: weights_only)."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as fh:
            metadata = _MetadataUnpickler(io.BytesIO(fh.read())).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _sharded_state(learner: Learner) -> tuple[dict, dict]:
    """(model, optimiser) state dicts as this rank holds them (FSDP shards, DTensors). Collective."""
    return get_state_dict(learner.model, learner.optimizer)


def save_checkpoint(learner: Learner) -> Path:
    """Writes a complete checkpoint of `learner` into a new folder (collective: every rank must call it).

    Each rank writes its shard of the model and optimiser (`torch.distributed.checkpoint`);
    rank 0 writes the extra state and state.json, renames the folder into place and then
    switches ``latest``. Nothing new since the latest checkpoint (its state.json equals the
    learner's state): nothing is written, and that checkpoint is returned.

    Returns:
        the checkpoint folder (on every rank).
    """
    root = checkpoint_root(learner.cfg.run_dir)
    state_text = _state_json(learner)
    decision: list = [None]
    if learner.rank == 0:
        prev = latest_checkpoint(learner.cfg.run_dir, fallback=True)
        if prev is not None and (prev / "state.json").read_text() == state_text:
            decision = [str(prev)]
        else:
            name = f"step_{learner.state.step:08d}"
            k = 0
            while (root / name).exists():
                k += 1
                name = f"step_{learner.state.step:08d}_r{k}"
            decision = [name]
            root.mkdir(parents=True, exist_ok=True)
            tmp = root / f".tmp-{name}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
    if learner.world > 1:
        dist.broadcast_object_list(decision, src=0)
    if "/" in decision[0]:  # nothing new: the latest checkpoint holds this state
        log.info("checkpoint: nothing new since %s", decision[0])
        return Path(decision[0])
    name = decision[0]
    final, tmp = root / name, root / f".tmp-{name}"
    model_sd, optim_sd = _sharded_state(learner)
    with warnings.catch_warnings():  # one process: DCP warns that it assumes so
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model_sd, "optim": optim_sd}, no_dist=learner.world == 1,
                 storage_writer=dcp.FileSystemWriter(tmp / DCP_DIR, sync_files=True))
    rngs = [_rng_state()]
    if learner.world > 1:
        gathered: list[dict | None] = [None] * learner.world
        dist.all_gather_object(gathered, rngs[0])
        rngs = gathered  # type: ignore[assignment]
    if learner.rank == 0:
        extra = {
            "scheduler": learner.scheduler.state_dict(),
            "shuffle_gen": learner.shuffle_gen.get_state(),
            "rng": rngs,
            "world": learner.world,
        }
        (tmp / EXTRA_JSON).write_text(extra_to_json(extra))
        (tmp / "state.json").write_text(state_text)
        for f in tmp.rglob("*"):
            if f.is_file():
                _fsync_file(f)
        _fsync_dir(tmp / DCP_DIR)
        _fsync_dir(tmp)
        os.replace(tmp, final)
        _fsync_dir(root)
        latest_tmp = root / f".{LATEST}.tmp"
        latest_tmp.write_text(name + "\n")
        _fsync_file(latest_tmp)
        os.replace(latest_tmp, root / LATEST)
        _fsync_dir(root)
        _prune(root, learner.cfg.keep_checkpoints, final)
        log.info("checkpoint %s (policy version %d)", final, learner.state.policy_version)
    _barrier(learner)
    return final


def _prune(root: Path, keep: int, keep_path: Path | None = None) -> None:
    """Deletes all but the newest `keep` checkpoints (never `keep_path`, the one `latest` names), and
    leftovers of interrupted writes."""
    done = sorted((p for p in root.glob("step_*") if p.is_dir() and _NAME.match(p.name)), key=_order)
    for p in done[:-keep]:
        if keep_path is None or p != keep_path:
            shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(".tmp-*"):
        shutil.rmtree(p, ignore_errors=True)


def latest_checkpoint(run_dir: str | Path, fallback: bool = True) -> Path | None:
    """The checkpoint to resume from: the folder ``latest`` names; None when there is none.

    With `fallback` (default), a ``latest`` that names a missing or incomplete folder, or is
    missing itself while checkpoint folders exist, gives the newest complete checkpoint
    (logged as a warning).

    Raises:
        FileNotFoundError: ``latest`` names a missing or incomplete folder and `fallback` is
            False, or no complete checkpoint is left to fall back to.
    """
    root = checkpoint_root(run_dir)
    pointer = root / LATEST
    named = root / pointer.read_text().strip() if pointer.is_file() else None
    if named is not None and _complete(named):
        return named
    candidates = sorted((p for p in root.glob("step_*") if p.is_dir() and _NAME.match(p.name) and _complete(p)),
                        key=_order) if root.is_dir() else []
    if named is None and not candidates:
        return None
    if not fallback or not candidates:
        raise FileNotFoundError(f"{pointer} names {named}, which is incomplete or missing"
                                + ("; no complete checkpoint to fall back to" if fallback else ""))
    log.warning("%s: %s; resuming from the newest complete checkpoint, %s", pointer,
                f"names {named.name}, which is incomplete or missing" if named is not None else "missing",
                candidates[-1].name)
    return candidates[-1]


def load_checkpoint(learner: Learner, path: str | Path | None = None) -> Path | None:
    """Restores `learner` from `path` (default: `latest_checkpoint`, with its fallback). Collective.

    Returns:
        the folder restored, or None when there is no checkpoint (fresh start).

    Raises:
        FileNotFoundError: no complete checkpoint to resume from although ``latest`` exists.
        ValueError: the DCP metadata refers to anything but DCP's own classes (refused, never
            run) or the shards do not match the model (the message names the folder).

    A checkpoint written by a different number of ranks loads (DCP reshards; an older
    full-state-dict checkpoint is broadcast from rank 0); ranks without a saved RNG state keep
    theirs, with a warning.
    """
    path = Path(path) if path is not None else latest_checkpoint(learner.cfg.run_dir)
    if path is None:
        return None
    if (path / DCP_DIR / ".metadata").is_file():
        model_sd, optim_sd = _sharded_state(learner)
        sd = {"model": model_sd, "optim": optim_sd}
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(sd, storage_reader=_SafeReader(path / DCP_DIR), no_dist=learner.world == 1)
        except CheckpointException as err:
            why = "; ".join(str(e).strip().splitlines()[-1] for e in err.failures.values()) or str(err)
            raise ValueError(f"{path / DCP_DIR}: refused or unreadable: {why}") from None
        set_state_dict(learner.model, learner.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    else:  # an older checkpoint: full state dicts on rank 0
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=learner.world > 1)
        full = learner.rank == 0 or learner.world == 1
        model_sd = torch.load(path / "model.pt", map_location="cpu", weights_only=True) if full else {}
        set_model_state_dict(learner.model, model_sd, options=opts)
        optim_sd = torch.load(path / "optim.pt", map_location="cpu", weights_only=True) if full else {}
        set_optimizer_state_dict(learner.model, learner.optimizer, optim_sd, options=opts)
    extra = load_extra(path)
    learner.scheduler.load_state_dict(extra["scheduler"])
    learner.shuffle_gen.set_state(extra["shuffle_gen"])
    rngs = extra["rng"]
    if learner.rank < len(rngs):
        _set_rng_state(rngs[learner.rank])
    if len(rngs) != learner.world:
        log.warning("checkpoint written by %d ranks, resuming on %d", len(rngs), learner.world)
    state = json.loads((path / "state.json").read_text())
    learner.state = LearnerState(**state)
    learner._trained = set(learner.state.trained_group_ids)
    log.info("resumed %s: step %d, policy version %d, %d trained groups", path, learner.state.step,
             learner.state.policy_version, len(learner._trained))
    return path
