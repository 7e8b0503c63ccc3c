"""Checkpoint and resume: weights, optimiser, scheduler, RNG, policy version, trained groups.

Layout: ``<run_dir>/checkpoints/step_<N:08d>/`` with ``model.pt`` (full state dict),
``optim.pt`` (full optimiser state), ``extra.json`` (scheduler, shuffle generator, the RNG
states of every rank) and ``state.json`` (step, policy version, trained group ids — the
record that makes training exactly-once), plus ``<run_dir>/checkpoints/latest`` naming
the newest one.

Nothing is unpickled: ``model.pt`` and ``optim.pt`` load with ``weights_only=True`` (tensors
and plain containers only), and the extra state is JSON (`extra_to_json`: tensors as dtype,
shape and base64 bytes, tuples tagged), so a checkpoint another process wrote cannot run code
in the learner. A checkpoint of an older version has ``extra.pt`` instead; it still loads,
with ``weights_only=True`` (what it holds, RNG byte tensors, ints, floats, lists, tuples and
dicts, passes); one that does not load that way is refused, naming the file.

Durability: rank 0 writes everything into a temporary folder, fsyncs each file, renames
the folder into place, fsyncs the parent, and only then rewrites ``latest`` (tmp +
rename). A checkpoint is therefore either complete or absent; a SIGKILL at any moment
leaves the previous one as ``latest``. The learner acknowledges groups in the buffer
only after `save_checkpoint` has returned.

Departure (scale): state dicts are gathered to rank 0 in full (torch.distributed
.checkpoint.state_dict with full_state_dict + cpu_offload) and loaded back with
broadcast_from_rank0. That is simple and exact for the models we train on CPU and one
node; for gpt-oss-20b on many nodes, a sharded DCP save would avoid the rank-0 gather.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
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


def save_checkpoint(learner: Learner) -> Path:
    """Writes a complete checkpoint of `learner` (collective: every rank must call it).

    Returns:
        the checkpoint folder (on every rank).
    """
    root = checkpoint_root(learner.cfg.run_dir)
    name = f"step_{learner.state.step:08d}"
    final = root / name
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(learner.model, options=opts)
    optim_sd = get_optimizer_state_dict(learner.model, learner.optimizer, options=opts)
    rngs = [_rng_state()]
    if learner.world > 1:
        gathered: list[dict | None] = [None] * learner.world
        dist.all_gather_object(gathered, rngs[0])
        rngs = gathered  # type: ignore[assignment]
    if learner.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".tmp-{name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        torch.save(model_sd, tmp / "model.pt")
        torch.save(optim_sd, tmp / "optim.pt")
        extra = {
            "scheduler": learner.scheduler.state_dict(),
            "shuffle_gen": learner.shuffle_gen.get_state(),
            "rng": rngs,
            "world": learner.world,
        }
        (tmp / EXTRA_JSON).write_text(extra_to_json(extra))
        (tmp / "state.json").write_text(json.dumps(learner.state.__dict__, indent=1))
        for f in tmp.iterdir():
            _fsync_file(f)
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        latest_tmp = root / f".{LATEST}.tmp"
        latest_tmp.write_text(name + "\n")
        _fsync_file(latest_tmp)
        os.replace(latest_tmp, root / LATEST)
        _fsync_dir(root)
        _prune(root, learner.cfg.keep_checkpoints)
        log.info("checkpoint %s (policy version %d)", final, learner.state.policy_version)
    _barrier(learner)
    return final


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step_*") if p.is_dir())
    for p in done[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(".tmp-*"):
        shutil.rmtree(p, ignore_errors=True)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The folder ``latest`` names, or None when there is no checkpoint."""
    root = checkpoint_root(run_dir)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not (path / "state.json").is_file():
        raise FileNotFoundError(f"{pointer} names {path}, which is incomplete or missing")
    return path


def load_checkpoint(learner: Learner, path: str | Path | None = None) -> Path | None:
    """Restores `learner` from `path` (default: the latest checkpoint). Collective.

    Returns:
        the folder restored, or None when there is no checkpoint (fresh start).

    Raises:
        FileNotFoundError: ``latest`` names a missing checkpoint.

    A checkpoint written by a different number of ranks loads (weights and optimiser are
    full state dicts); ranks without a saved RNG state keep theirs, with a warning.
    """
    path = Path(path) if path is not None else latest_checkpoint(learner.cfg.run_dir)
    if path is None:
        return None
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=learner.world > 1)
    model_sd = torch.load(path / "model.pt", map_location="cpu", weights_only=True) if learner.rank == 0 or learner.world == 1 else {}
    set_model_state_dict(learner.model, model_sd, options=opts)
    optim_sd = torch.load(path / "optim.pt", map_location="cpu", weights_only=True) if learner.rank == 0 or learner.world == 1 else {}
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
