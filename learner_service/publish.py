"""Publishing a policy version: transformers-format weights + RolloutService.UpdateWeights.

``<run_dir>/policy/v<N>/`` holds the weights as safetensors with config.json (and the
tokenizer when the model came from a folder that has one), loadable with
``AutoModelForCausalLM.from_pretrained`` and by vLLM. The folder is written under a
temporary name and renamed into place, so a reader never sees a half-written version. Every
file in it gets the mode a plain ``open()`` gives (0644 under umask 022): safetensors 0.8
writes ``model.safetensors`` through a private (0600) temporary file of its own.
Then, when a rollout address is configured, ``UpdateWeights(policy_version=N,
location=<folder>)`` is called; a failed call is logged and returned, never fatal (the
rollout service can catch up with `PolicyVersion`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from learner_service.checkpoint import full_model_state_dict
from learner_service.trainer import Learner
from sinkflex.chat_templates import with_tool_use

log = logging.getLogger(__name__)

#: A model folder with any of these has a tokenizer (published with its own `save_pretrained`).
TOKENIZER_MARKERS = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


@dataclass(frozen=True)
class Published:
    policy_version: int
    location: str
    update_error: str = ""  # non-empty when UpdateWeights failed
    load_seconds: float = 0.0  # reported by the rollout service


def policy_dir(run_dir: str | Path, version: int) -> Path:
    return Path(run_dir) / "policy" / f"v{version}"


def publish_policy(learner: Learner, timeout_s: float = 600.0) -> Published:
    """Writes the current weights as policy version `learner.state.policy_version` and
    tells the rollout service. Collective (the state dict is gathered); rank 0 writes.

    Returns:
        what was published (on rank 0; other ranks get the same version and location).
    """
    version = learner.state.policy_version
    out = policy_dir(learner.cfg.run_dir, version)
    state_dict = full_model_state_dict(learner)
    result = Published(version, str(out.resolve()))
    if learner.rank == 0:
        tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        learner.model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        _fix_architectures(tmp / "config.json", learner.arch_name)
        src = learner.cfg.model.path
        if src is not None:
            _copy_tokenizer(Path(src), tmp)
        _usual_file_modes(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        _prune(out.parent, learner.cfg.keep_policies, protect=learner.state.warm_start_version)
        if learner.cfg.rollout_address:
            result = _update_weights(learner.cfg.rollout_address, version, result.location, timeout_s)
        log.info("published policy version %d at %s", version, out)
    learner.state.published_version = version
    learner.state.published_location = result.location
    return result


def _copy_tokenizer(src: Path, out: Path) -> None:
    """The tokenizer of the model folder `src` into `out`, written by the tokenizer's own
    `save_pretrained` (every file it needs: vocab, merges, sentencepiece model, chat template,
    ...), and `src`'s generation_config.json as is (vLLM's sampling defaults); nothing for a
    folder without a tokenizer (`TOKENIZER_MARKERS`). A chat template that does not render tools
    itself gets a named ``tool_use`` template beside it (`sinkflex.chat_templates.with_tool_use`),
    which renders ``apply_chat_template(messages, tools=...)`` as the rollouts were rendered in
    training (the Hermes tool block, ``<tool_call>`` and ``<tool_response>``): what ``vllm serve``
    of the version gives a client that sends tools; without tools the model's own template renders.

    Raises:
        OSError, ValueError: `src` has tokenizer files that transformers cannot load.
    """
    if any((src / name).is_file() for name in TOKENIZER_MARKERS):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(src)
        tokenizer.chat_template = with_tool_use(tokenizer.chat_template)
        tokenizer.save_pretrained(out)
    if (src / "generation_config.json").is_file():
        shutil.copy2(src / "generation_config.json", out / "generation_config.json")


def _usual_file_modes(folder: Path) -> None:
    """Gives every file under `folder` the mode a file created there with a plain `open()` gets
    (0o666 less the process umask). safetensors >= 0.8 saves through a temporary file created
    0600 and renamed into place (safetensors/safetensors#782), so `model.safetensors` would be
    the one file of a published version that other users (a vLLM server run as another user)
    cannot read. The mode is read from a probe file rather than with `os.umask`, which would
    change the umask of the whole process for a moment."""
    probe = folder / f".mode-probe-{os.getpid()}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
        probe.unlink()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink() and stat.S_IMODE(path.stat().st_mode) != mode:
            os.chmod(path, mode)


def _fix_architectures(config_json: Path, arch_name: str) -> None:
    """FSDP2 renames the model class (FSDPGptOssForCausalLM); the folder must name the real one."""
    cfg = json.loads(config_json.read_text())
    cfg["architectures"] = [arch_name]
    config_json.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _prune(root: Path, keep: int, protect: int = 0) -> None:
    """Deletes all but the newest `keep` versions, never version `protect` (the warm start's: the KL reference)."""
    versions = sorted((p for p in root.glob("v*") if p.is_dir() and p.name[1:].isdigit()), key=lambda p: int(p.name[1:]))
    for p in versions[:-keep]:
        if protect and p.name == f"v{protect}":
            continue
        shutil.rmtree(p, ignore_errors=True)


def _update_weights(address: str, version: int, location: str, timeout_s: float) -> Published:
    """RolloutService.UpdateWeights through the rollout client (`rollout_service.client`); a failure
    is logged and returned in `Published.update_error`, never raised."""
    from rollout_service.client import GrpcRolloutClient
    from sinkflex.errors import ServiceError

    with GrpcRolloutClient(address, timeout=timeout_s) as client:
        try:
            resp = client.update_weights(version, location)
        except ServiceError as e:
            log.warning("UpdateWeights(v%d) at %s failed: %s", version, address, e)
            return Published(version, location, update_error=str(e))
    return Published(version, location, load_seconds=resp.load_seconds)
