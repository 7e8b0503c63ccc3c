"""`python -m learner_service` as real processes on a real Redis buffer: FSDP2 over gloo
with torchrun, and SIGKILL + restart with exactly-once training."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import yaml

from learner_service.trainer import Learner
from sinkflex.buffer import TrajectoryBuffer, embedded_redis_url
from tests.fixtures.learner import TINY_GPT_OSS, learner_config, make_group, one_thread

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
#: Adam with eps ≫ |g| is SGD (update ≈ lr·g/eps): compares gradients, not sign(g) noise.
LINEAR_ADAM = dict(lr=1e3, eps=1e3, max_grad_norm=None)


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def _write_config(path: Path, cfg) -> Path:
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return path


@pytest.fixture
def buffer():
    url = embedded_redis_url()
    buf = TrajectoryBuffer(url=url, stream=f"test-learner:{uuid.uuid4().hex[:8]}", claim_idle_ms=1500)
    yield buf
    buf.delete()
    buf.close()


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_fsdp_two_ranks_equal_one_rank(tmp_path, buffer):
    groups = [make_group("fa", [0.0, 1.0, 0.4], seed=11), make_group("fb", [1.0, 0.0, 0.0, 0.5], seed=12)]
    for g in groups:
        buffer.put(g)
    over = dict(optim=LINEAR_ADAM, batch=dict(groups_per_step=2, micro_batch_size=1),
                buffer=dict(url=buffer.url, stream=buffer.stream, block_ms=200, claim_idle_ms=60_000),
                grpo=dict(beta=0.05))
    cfg2 = learner_config(tmp_path / "fsdp", TINY_GPT_OSS, **over)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "learner_service", "--config", str(_write_config(tmp_path / "c.yaml", cfg2)), "--no-server", "--max-steps", "1"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "[rank 1]" in proc.stderr  # two ranks really ran
    state = json.loads((tmp_path / "fsdp/checkpoints/step_00000001/state.json").read_text())
    assert state["policy_version"] == 1 and sorted(state["trained_group_ids"]) == ["fa", "fb"]
    stats = buffer.stats()
    assert stats.unconsumed == 0 and stats.trained == 2  # acknowledged after the checkpoint
    two = _weights(tmp_path / "fsdp/policy/v1")

    with one_thread():
        single = Learner(learner_config(tmp_path / "single", TINY_GPT_OSS, **over), metrics=False)
        before = {k: v.detach().clone() for k, v in single.model.state_dict().items()}
        single.train_step(groups)
        one = {k: v.detach() for k, v in single.model.state_dict().items()}
    assert set(two) == set(one)
    for k in one:
        assert not torch.equal(one[k], before[k]), k
        torch.testing.assert_close(two[k], one[k], rtol=1e-4, atol=1e-5, msg=k)


#: `python -m learner_service` with a fault hook the test injects: SIGKILL right after the checkpoint of
#: learner step argv[1] is durable, before its groups are acknowledged (the service reads no hook)
KILL_BEFORE_ACK = """
import os, signal, sys
import learner_service.loop as loop
step = int(sys.argv.pop(1))
save = loop.save_checkpoint
def save_then_kill(learner, *args, **kwargs):
    path = save(learner, *args, **kwargs)
    if learner.state.step == step:
        os.kill(os.getpid(), signal.SIGKILL)
    return path
loop.save_checkpoint = save_then_kill
from learner_service.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def _start(cfg_path: Path, kill_before_ack: int | None = None) -> subprocess.Popen:
    log = open(cfg_path.with_suffix(f".{time.monotonic_ns()}.log"), "w")
    head = ["-m", "learner_service"] if kill_before_ack is None else ["-c", KILL_BEFORE_ACK, str(kill_before_ack)]
    return subprocess.Popen([sys.executable, *head, "--config", str(cfg_path), "--no-server", "--max-steps", "6"],
                            cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT)


def _records(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def _latest_state(run_dir: Path) -> dict:
    name = (run_dir / "checkpoints/latest").read_text().strip()
    return json.loads((run_dir / "checkpoints" / name / "state.json").read_text())


def test_sigkill_and_restart_trains_every_group_exactly_once(tmp_path, buffer):
    ids = [f"k{i}" for i in range(6)]
    for i, gid in enumerate(ids):
        buffer.put(make_group(gid, [0.0, 1.0, 0.3], seed=20 + i))
    run_dir = tmp_path / "run"
    cfg = learner_config(run_dir, TINY_GPT_OSS, batch=dict(groups_per_step=1, micro_batch_size=2),
                         buffer=dict(url=buffer.url, stream=buffer.stream, block_ms=200, claim_idle_ms=1500))
    cfg_path = _write_config(tmp_path / "c.yaml", cfg)

    # 1) killed right after step 2's checkpoint is durable, before its group is acknowledged.
    p = _start(cfg_path, kill_before_ack=2)
    assert p.wait(timeout=300) == -signal.SIGKILL
    s = _latest_state(run_dir)
    assert s["policy_version"] == 2 and len(s["trained_group_ids"]) == 2
    assert buffer.stats().pending >= 1  # step 2's group: trained, checkpointed, not acknowledged

    # 2) restarted, then SIGKILLed from outside at an arbitrary point of step 4 or later.
    p = _start(cfg_path)
    deadline = time.monotonic() + 300
    while not any(r["policy_version"] >= 4 for r in _records(run_dir)[2:]):
        assert p.poll() is None and time.monotonic() < deadline, "learner stopped early"
        time.sleep(0.02)
    resumed = _records(run_dir)[2]
    assert resumed["policy_version"] == 3  # resumed at version 2, the checkpoint's
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    at_kill = _latest_state(run_dir)["policy_version"]
    assert at_kill >= 3
    n_before = len(_records(run_dir))

    # 3) restarted again: runs to 6 steps and exits cleanly.
    p = _start(cfg_path)
    assert p.wait(timeout=300) == 0
    s = _latest_state(run_dir)
    assert s["step"] == s["policy_version"] == 6  # one version per group: none trained twice
    assert sorted(s["trained_group_ids"]) == ids  # and none lost
    stats = buffer.stats()
    assert stats.unconsumed == 0 and stats.pending == 0 and stats.trained == 6
    assert (run_dir / "policy/v6/config.json").is_file()
    records = _records(run_dir)
    assert records[-1]["policy_version"] == 6 and {r["policy_version"] for r in records} == {1, 2, 3, 4, 5, 6}
    # The restart continued from its checkpoint (a step trained but not checkpointed before
    # the kill, if any, is redone with the same version number).
    if at_kill < 6:
        assert records[n_before]["policy_version"] == at_kill + 1


def test_served_learner_stops_gracefully_on_sigterm(tmp_path, buffer):
    from sinkflex.api.learner.v1 import learner_pb2, learner_pb2_grpc
    from sinkflex_rl.launcher import free_port
    from sinkflex.serving import make_channel, wait_for_serving

    buffer.put(make_group("t0", [0.0, 1.0], seed=30))
    cfg = learner_config(tmp_path / "run", TINY_GPT_OSS, batch=dict(groups_per_step=1),
                         buffer=dict(url=buffer.url, stream=buffer.stream, block_ms=100))
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "learner_service", "--config", str(_write_config(tmp_path / "c.yaml", cfg)),
                          "--port", str(port), "--metrics-port", "-1"], cwd=REPO, env=_env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        with make_channel(f"127.0.0.1:{port}") as ch:
            wait_for_serving(ch, "sinkflex.api.learner.v1.LearnerService", timeout=240)
            stub = learner_pb2_grpc.LearnerServiceStub(ch)
            deadline = time.monotonic() + 120
            while stub.Status(learner_pb2.StatusRequest()).step < 1:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            while stub.PolicyVersion(learner_pb2.PolicyVersionRequest()).policy_version < 1:  # published after the checkpoint
                assert time.monotonic() < deadline
                time.sleep(0.1)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err[-3000:]
        assert "stopped at step 1, policy version 1" in err
    finally:
        if p.poll() is None:
            p.kill()
    assert _latest_state(tmp_path / "run")["policy_version"] == 1
    assert buffer.stats().unconsumed == 0
