"""Sharded checkpoints (`learner_service.checkpoint`, torch.distributed.checkpoint): a new folder per
checkpoint with `latest` switched atomically, a no-op when nothing changed, resume falling back to the
newest complete checkpoint, older full-state-dict checkpoints still loading, metadata never
unpickled beyond DCP's own classes, and a checkpoint of 2 ranks resumed on 1."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from learner_service.checkpoint import DCP_DIR, LATEST, checkpoint_root, latest_checkpoint, load_checkpoint, save_checkpoint
from learner_service.trainer import Learner
from tests.fixtures.learner import TINY_GPT_OSS, learner_config, make_group, one_thread

pytestmark = pytest.mark.timeout(600)


def _weights(learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def trained(tmp_path):
    with one_thread():
        learner = Learner(learner_config(tmp_path, TINY_GPT_OSS), metrics=False)
        learner.train_step([make_group("a", [0.0, 1.0, 0.5], seed=1)])
        yield learner


def test_each_checkpoint_is_a_new_folder_and_nothing_new_is_a_no_op(trained, tmp_path):
    root = checkpoint_root(tmp_path)
    first = save_checkpoint(trained)
    assert first.name == "step_00000001" and (first / DCP_DIR / ".metadata").is_file()
    assert any(p.suffix == ".distcp" for p in (first / DCP_DIR).iterdir()) and not (first / "model.pt").exists()
    mtime = (first / "state.json").stat().st_mtime_ns
    assert save_checkpoint(trained) == first  # nothing new: nothing written
    assert sorted(p.name for p in root.iterdir()) == [LATEST, "step_00000001"]
    assert (first / "state.json").stat().st_mtime_ns == mtime
    trained.state.groups_dropped_stale += 1  # same step, new state: a new folder, the old one kept until pruned
    second = save_checkpoint(trained)
    assert second.name == "step_00000001_r1" and (root / LATEST).read_text().strip() == second.name
    assert json.loads((second / "state.json").read_text())["groups_dropped_stale"] == 1
    assert first.is_dir() or trained.cfg.keep_checkpoints < 2


def test_resume_falls_back_to_the_newest_complete_checkpoint(trained, tmp_path, caplog):
    root = checkpoint_root(tmp_path)
    good = save_checkpoint(trained)
    w1 = _weights(trained)
    trained.train_step([make_group("b", [1.0, 0.0, 0.2], seed=2)])
    later = save_checkpoint(trained)
    (later / "state.json").unlink()  # a disk that lost part of the newest checkpoint
    (root / ".tmp-step_00000003").mkdir()  # and an interrupted write
    assert latest_checkpoint(tmp_path) == good
    with pytest.raises(FileNotFoundError, match="incomplete or missing"):
        latest_checkpoint(tmp_path, fallback=False)
    with one_thread():
        fresh = Learner(learner_config(tmp_path, TINY_GPT_OSS), metrics=False)
        assert load_checkpoint(fresh) == good
    assert fresh.state.step == 1 and _same(_weights(fresh), w1)
    shutil.rmtree(later)
    (root / LATEST).write_text("step_00000009\n")  # names a folder that is gone
    assert latest_checkpoint(tmp_path) == good
    shutil.rmtree(good)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        latest_checkpoint(tmp_path)


def test_an_older_full_state_dict_checkpoint_still_loads(trained, tmp_path):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    path = save_checkpoint(trained)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    torch.save(get_model_state_dict(trained.model, options=opts), path / "model.pt")
    torch.save(get_optimizer_state_dict(trained.model, trained.optimizer, options=opts), path / "optim.pt")
    shutil.rmtree(path / DCP_DIR)
    with one_thread():
        old = Learner(learner_config(tmp_path, TINY_GPT_OSS), metrics=False)
        assert load_checkpoint(old) == path
    assert _same(_weights(old), _weights(trained)) and old.state.step == 1


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_checkpoint_metadata_that_would_run_code_is_refused(trained, tmp_path):
    path = save_checkpoint(trained)
    (path / DCP_DIR / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with one_thread():
        other = Learner(learner_config(tmp_path, TINY_GPT_OSS), metrics=False)
        with pytest.raises(ValueError, match="builtins.print: refused") as err:
            load_checkpoint(other)
    assert "pwned" not in str(err.value)


def test_two_rank_sharded_checkpoint_resumes_on_one_rank(tmp_path):
    """Two FSDP ranks each write their shard; one rank loads them (resharded) and holds exactly
    the weights published for that step."""
    import yaml
    from safetensors.torch import load_file

    cfg = learner_config(tmp_path / "two", TINY_GPT_OSS, batch=dict(groups_per_step=1, micro_batch_size=1),
                         warm_start=dict(), buffer=dict(block_ms=100))
    demo = tmp_path / "demos.bin"
    from learner_service.sft import write_demonstrations

    write_demonstrations(demo, [make_group(f"d{i}", [1.0], seed=i) for i in range(2)])
    data = cfg.model_dump(mode="json")
    data["warm_start"] = {"demonstrations": str(demo), "epochs": 1, "batch_size": 2, "lr": 1e-2}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "learner_service",
           "--config", str(tmp_path / "c.yaml"), "--no-server", "--max-steps", "0"]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=500, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ck = latest_checkpoint(tmp_path / "two")
    assert sorted(p.name for p in (ck / DCP_DIR).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    published = load_file(str(tmp_path / "two" / "policy" / "v1" / "model.safetensors"))
    with one_thread():
        one = Learner(learner_config(tmp_path / "two", TINY_GPT_OSS), metrics=False)
        assert load_checkpoint(one) == ck
    got = one.model.state_dict()
    for k, v in published.items():
        assert torch.equal(got[k].to(v.dtype), v), k
