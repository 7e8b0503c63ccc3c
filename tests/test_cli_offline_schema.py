"""`bin/sinkflex-rl` leaves hub access to the command (`models prepare ORG/NAME --hub` downloads),
the services it launches run offline, and `config schema` carries the fields' docstrings."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from sinkflex_rl.cli import app
from sinkflex_rl.config import TrainConfig, load_train_config
from sinkflex_rl.local import OFFLINE

ROOT = Path(__file__).resolve().parent.parent


def _fake_checkout(tmp_path: Path) -> Path:
    """bin/sinkflex-rl in a folder whose bootstrap does nothing and whose .venv's entry point runs
    this checkout's CLI with this interpreter."""
    root = tmp_path / "checkout"
    (root / "bin").mkdir(parents=True)
    shutil.copy2(ROOT / "bin" / "sinkflex-rl", root / "bin" / "sinkflex-rl")
    (root / "scripts").mkdir()
    (root / "scripts" / "bootstrap.sh").write_text("#!/bin/sh\nexit 0\n")
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".venv" / "bin" / "sinkflex-rl").write_text(
        f'#!/bin/sh\nexport PYTHONPATH={ROOT}\nexec {sys.executable} -m sinkflex_rl.cli "$@"\n')
    for f in (root / "scripts" / "bootstrap.sh", root / ".venv" / "bin" / "sinkflex-rl"):
        f.chmod(0o755)
    return root


def test_bin_script_lets_models_prepare_hub_download(tmp_path):
    """Through bin/sinkflex-rl, `models prepare ORG/NAME --hub` tries the hub (here an endpoint that
    refuses the connection) instead of failing on HF_HUB_OFFLINE."""
    root = _fake_checkout(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_CACHE=str(tmp_path / "cache"), HF_HUB_ETAG_TIMEOUT="2",
               HF_HUB_DOWNLOAD_TIMEOUT="2")
    out = subprocess.run([str(root / "bin" / "sinkflex-rl"), "models", "prepare", "someorg/somemodel", "--hub"],
                         capture_output=True, text=True, env=env, timeout=120, check=False)
    assert out.returncode == 2, out.stderr
    assert "downloading from the Hugging Face hub (http://127.0.0.1:9) failed" in out.stderr
    assert "HF_HUB_OFFLINE" not in out.stderr
    # without --hub: the local cache only, never the network
    out = subprocess.run([str(root / "bin" / "sinkflex-rl"), "models", "prepare", "someorg/somemodel"],
                         capture_output=True, text=True, env=env, timeout=120, check=False)
    assert out.returncode == 2 and "hub downloads are off" in out.stderr


def test_launched_services_run_offline(tmp_path, monkeypatch):
    """Every process `launch_local` starts gets HF_HUB_OFFLINE=1 (they load resolved local folders)."""
    from sinkflex_rl import local

    started = []

    class Recorder:
        def watch(self, *a):
            pass

        def start_all(self, specs, ready_timeout):
            started.extend(specs)

    monkeypatch.setattr(local, "_model", lambda cfg, field: str(tmp_path))
    cfg = load_train_config(ROOT / "configs" / "demo.yaml", [f"run.output_dir={tmp_path / 'run'}",
                                                              "services.redis_url=redis://127.0.0.1:1", "task.generate=null",
                                                              "task.train_split=base", "task.eval_split=base",
                                                              "warm_start.enabled=false"])
    local.launch_local(cfg, Recorder(), visible=[])
    assert {s.name for s in started} >= {"env", "reward", "rollout", "learner"}
    for spec in started:
        assert {k: spec.env.get(k) for k in OFFLINE} == OFFLINE, spec.name


def test_config_schema_carries_field_docstrings():
    result = CliRunner().invoke(app, ["config", "schema"])
    assert result.exit_code == 0, result.output
    schema = json.loads(result.stdout)
    run = schema["$defs"]["RunConfig"]["properties"]
    assert run["steps"]["description"].startswith("Learner steps = policy versions to train")
    assert TrainConfig.model_fields["run"].annotation.__doc__.strip() == schema["$defs"]["RunConfig"]["description"]
    rollout = schema["$defs"]["RolloutSettings"]["properties"]
    assert rollout["max_staleness"]["description"].startswith("k: how many policy versions")
    # a service section's own classes too
    grpo = schema["properties"]["learner_service"]["$defs"]["GRPOConfig"]
    described = [name for name, p in grpo["properties"].items() if p.get("description")]
    assert len(described) >= len(grpo["properties"]) // 2, described
