"""W&B and MLflow beside JSON lines and TensorBoard (`logging.report_to`, sinkflex.tracking):
a tracker whose package is missing is a config error at load, naming the field and the
install command; with the package present (the dev extras install both), every record reaches
W&B (offline, files under the run folder) and MLflow (its local SQLite store in the run folder)
with its step, and a re-run resumes the same tracker run."""

from __future__ import annotations

import json
import time
import logging

import pytest

from sinkflex import tracking
from sinkflex.config import ConfigError, validate_config
from sinkflex.reporting import MetricsWriter, read_metrics
from sinkflex.tracking import ReportingConfig, open_trackers


def test_missing_package_is_a_clear_error_at_load(monkeypatch, tmp_path):
    from sinkflex_rl.config import load_train_config

    monkeypatch.setattr(tracking, "_missing", lambda module: module == "wandb")
    cfg = tmp_path / "exp.yaml"
    cfg.write_text("run: {name: t}\n")
    with pytest.raises(ConfigError) as err:
        load_train_config(cfg, ["logging.report_to=[mlflow, wandb]"])
    msg = str(err.value)
    assert "logging.report_to: Value error, 'wandb' is configured but the wandb package is not installed" in msg
    assert "-m pip install wandb; in a checkout: pip install -e '.[wandb]')" in msg and "logging.report_to=[mlflow, wandb]" in msg
    assert "mlflow" not in msg.split("not installed")[0].replace("[mlflow, wandb]", "")  # only the missing one is named
    assert load_train_config(cfg).logging.report_to == []  # nothing configured: nothing needed


def test_unknown_tracker_and_the_real_import_check():
    with pytest.raises(ConfigError, match=r"report_to\.0: Input should be 'wandb' or 'mlflow'"):
        validate_config({"report_to": ["comet"]}, ReportingConfig)
    assert tracking._missing("surely_no_such_module_sinkflex") and not tracking._missing("yaml")


def test_mlflow_local_store_needs_sqlalchemy(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(tracking, "_missing", lambda module: module == "sqlalchemy")
    with pytest.raises(ConfigError, match="local SQLite store, which needs sqlalchemy"):
        validate_config({"report_to": ["mlflow"]}, ReportingConfig)
    assert validate_config({"report_to": ["mlflow"], "mlflow": {"tracking_uri": "http://mlflow:5000"}},
                           ReportingConfig).report_to == ["mlflow"]


class _Broken:
    name = "broken"
    closed = False

    def log(self, kind, step, metrics):
        raise ConnectionError("server gone")

    def close(self):
        self.closed = True


def test_a_failing_tracker_never_stops_the_record(tmp_path, caplog):
    broken = _Broken()
    w = MetricsWriter(tmp_path, tensorboard=False, trackers=[broken])
    with caplog.at_level(logging.WARNING, logger="sinkflex.reporting"):
        w.write("train", 1, {"loss": 0.5})
        w.write("train", 2, {"loss": 0.25})
    w.close()
    assert [r["loss"] for r in read_metrics(tmp_path)] == [0.5, 0.25]
    assert sum("broken: could not log a train record" in r.message for r in caplog.records) == 1
    assert broken.closed


RECORDS = [("train", 1, {"loss": 0.5, "reward_mean": 0.25, "groups": 2}),
           ("train", 2, {"loss": 0.125, "reward_mean": 0.75, "groups": 2}),
           ("val", 3, {"mean_at_1": 0.5, "policy_version": 3})]


def test_mlflow_local_store_in_the_run_folder(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.chdir(tmp_path)
    settings = validate_config({"report_to": ["mlflow"], "mlflow": {"experiment": "exp-a", "tags": {"team": "rl"}}},
                               ReportingConfig)
    run_dir = tmp_path / "runs" / "demo"
    config = {"run": {"name": "demo", "steps": 2}, "rollout": {"group_size": 4}}
    w = MetricsWriter(run_dir, tensorboard=False, trackers=open_trackers(run_dir, settings, "demo", config))
    for kind, step, m in RECORDS[:2]:
        w.write(kind, step, m)
    w.close()
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    # a re-run of the same folder resumes the same MLflow run
    w = MetricsWriter(run_dir, tensorboard=False, trackers=open_trackers(run_dir, settings, "demo", config))
    w.write(*RECORDS[2])
    w.close()
    assert json.loads((run_dir / "trackers.json").read_text())["mlflow"] == run_id

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.resolve() / 'mlflow' / 'mlflow.db'}")
    run = client.get_run(run_id)
    assert run.info.run_name == "demo" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "exp-a"
    assert run.data.tags["team"] == "rl"
    assert run.data.params == {"run.name": "demo", "run.steps": "2", "rollout.group_size": "4"}
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")] == [(1, 0.5), (2, 0.125)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "val/mean_at_1")] == [(3, 0.5)]
    assert run.info.artifact_uri.startswith((run_dir.resolve() / "mlflow" / "artifacts").as_uri())
    assert "config.yaml" in [f.path for f in client.list_artifacts(run_id)]
    assert not list(tmp_path.glob("mlruns")) and not (tmp_path / "mlflow.db").exists()  # nothing outside the run folder


def test_wandb_offline_in_the_run_folder(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_DIR", "WANDB_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    settings = validate_config({"report_to": ["wandb"], "wandb": {"mode": "offline", "project": "p", "tags": ["cpu"]}},
                               ReportingConfig)
    run_dir = tmp_path / "run"
    (tracker,) = open_trackers(run_dir, settings, "demo", {"run": {"name": "demo"}})
    w = MetricsWriter(run_dir, tensorboard=False, trackers=[tracker])
    for kind, step, m in RECORDS:
        w.write(kind, step, m)
    run = tracker.run
    assert run.project == "p" and run.name == "demo" and list(run.tags) == ["cpu"]
    assert run.config["run"] == {"name": "demo"}
    assert run.summary["train/loss"] == 0.125 and run.summary["train/step"] == 2
    assert run.summary["val/mean_at_1"] == 0.5 and run.summary["val/step"] == 3
    w.close()
    assert json.loads((run_dir / "trackers.json").read_text()) == {"wandb": run.id}
    (offline,) = (run_dir / "wandb").glob(f"offline-run-*-{run.id}")
    (log_file,) = offline.glob(f"run-{run.id}.wandb")  # what `wandb sync` uploads
    deadline = time.monotonic() + 120  # wandb-core writes it asynchronously: slow on a loaded machine
    while log_file.stat().st_size <= 1000 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert log_file.stat().st_size > 1000
