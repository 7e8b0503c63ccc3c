"""W&B and MLflow trackers for `MetricsWriter` (sinkflex.reporting), TRL's `report_to`:
`ReportingConfig` (an experiment's `logging:` section; an entry whose package is missing is an
error at load), `WandbTracker`, `MlflowTracker` and `open_trackers`. The packages are imported
only when a tracker is opened, so no image or service needs them unless configured.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import field_validator, model_validator

from sinkflex.config import StrictModel

#: what each `report_to` entry needs importable, and how to get it
TRACKER_PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}


def _missing(module: str) -> bool:

    return importlib.util.find_spec(module) is None


class WandbSettings(StrictModel):
    """Weights & Biases (`wandb.init`'s arguments). Unset fields leave wandb's own defaults and
    environment variables (WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE, WANDB_API_KEY) in charge."""

    project: Optional[str] = None
    """default: WANDB_PROJECT, else "sinkflex-rl"."""
    entity: Optional[str] = None
    group: Optional[str] = None
    tags: list[str] = []
    mode: Optional[Literal["online", "offline", "disabled"]] = None
    """offline: write only to <run dir>/wandb/ (`wandb sync` uploads it later); default: WANDB_MODE, else online."""


class MlflowSettings(StrictModel):
    """MLflow (`mlflow.MlflowClient`)."""

    tracking_uri: Optional[str] = None
    """A tracking server (http://host:5000) or database URI; default: MLFLOW_TRACKING_URI, else
    sqlite:///<run dir>/mlflow/mlflow.db with artifacts beside it (`mlflow ui --backend-store-uri …`)."""
    experiment: Optional[str] = None
    """default: MLFLOW_EXPERIMENT_NAME, else "sinkflex-rl"."""
    tags: dict[str, str] = {}


class ReportingConfig(StrictModel):
    """Where metrics go besides <run dir>/metrics.jsonl and TensorBoard (always written): TRL's
    `report_to`. Checked at load: an entry whose package is not installed is an error then,
    not mid-run."""

    report_to: list[Literal["wandb", "mlflow"]] = []
    """Trackers to mirror every metric record to (tags `<kind>/<name>`, as in TensorBoard)."""
    wandb: WandbSettings = WandbSettings()
    mlflow: MlflowSettings = MlflowSettings()

    @field_validator("report_to")
    @classmethod
    def _installed(cls, report_to: list[str]) -> list[str]:

        for name in dict.fromkeys(report_to):
            module, package = TRACKER_PACKAGES[name]
            if _missing(module):
                raise ValueError(
                    f"{name!r} is configured but the {package} package is not installed in {sys.executable}: "
                    f"install it ({sys.executable} -m pip install {package}; in a checkout: pip install -e '.[{name}]') "
                    f"or remove {name!r} from report_to")
        return list(dict.fromkeys(report_to))

    @model_validator(mode="after")
    def _mlflow_local_store(self) -> "ReportingConfig":

        if "mlflow" in self.report_to and not (self.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")):
            missing = [m for m in ("sqlalchemy", "alembic") if _missing(m)]
            if missing:
                raise ValueError(
                    f"mlflow with no tracking_uri (nor MLFLOW_TRACKING_URI) writes a local SQLite store, which needs "
                    f"{' and '.join(missing)} (pip install mlflow, not mlflow-skinny); or set mlflow.tracking_uri to a server")
        return self


class WandbTracker:
    """Mirrors records to a W&B run (`wandb.init` in <run dir>/wandb/, resumed by id on a re-run).

    Each kind of record has its own x-axis (`wandb.define_metric("<kind>/*", step_metric="<kind>/step")`):
    train steps, policy versions for validations.
    """

    name = "wandb"

    def __init__(self, run_dir: Path, settings: WandbSettings, run_name: str, config: Mapping | None, run_id: str | None):

        import wandb

        self._wandb = wandb
        self._kinds: set[str] = set()
        self.run = wandb.init(
            project=settings.project or os.environ.get("WANDB_PROJECT") or "sinkflex-rl",
            entity=settings.entity, group=settings.group, tags=settings.tags or None, mode=settings.mode,
            name=run_name, dir=str(run_dir), config=dict(config or {}),
            id=run_id, resume="allow", reinit="create_new",
        )
        self.run_id = self.run.id

    def log(self, kind: str, step: int, metrics: Mapping[str, float]) -> None:
        if kind not in self._kinds:
            self.run.define_metric(f"{kind}/step")
            self.run.define_metric(f"{kind}/*", step_metric=f"{kind}/step")
            self._kinds.add(kind)
        self.run.log({f"{kind}/step": step, **{f"{kind}/{k}": v for k, v in metrics.items()}})

    def close(self) -> None:
        import wandb

        self.run.finish()  # flushes the run's files
        wandb.teardown()  # and stops this process's wandb-core service (it would outlive the run)


class MlflowTracker:
    """Mirrors records to an MLflow run (`mlflow.MlflowClient`: `log_batch` with each record's step;
    the experiment's config as params and as the artifact config.yaml; resumed by run id on a re-run)."""

    name = "mlflow"

    def __init__(self, run_dir: Path, settings: MlflowSettings, run_name: str, config: Mapping | None, run_id: str | None):

        from mlflow import MlflowClient

        local = run_dir.resolve() / "mlflow"
        uri = settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            local.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{local / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        self.tracking_uri = uri
        if run_id is None:
            name = settings.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "sinkflex-rl"
            exp = self.client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(
                name, artifact_location=None if settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
                else (local / "artifacts").as_uri())
            run_id = self.client.create_run(exp_id, run_name=run_name, tags=dict(settings.tags)).info.run_id
            if config:
                from mlflow.entities import Param

                params = [Param(k, str(v)[:500]) for k, v in _flatten(config).items()]
                for i in range(0, len(params), 100):  # log_batch takes at most 100 params
                    self.client.log_batch(run_id, params=params[i:i + 100])
                self.client.log_dict(run_id, dict(config), "config.yaml")
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def log(self, kind: str, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(f"{kind}/{k}", float(v), now, int(step)) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and math.isfinite(v)]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(data: Mapping, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


TRACKERS_FILE = "trackers.json"


def open_trackers(run_dir: str | Path, reporting: ReportingConfig, run_name: str,
                  config: Mapping | None = None) -> list:
    """The trackers `reporting.report_to` names, started now (a failure to start, e.g. a wrong
    W&B key or an unreachable MLflow server, raises here, before training). Their run ids are
    kept in <run dir>/trackers.json so that a re-run of the same run folder resumes the same
    W&B / MLflow run."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ids_path = run_dir / TRACKERS_FILE
    ids = json.loads(ids_path.read_text()) if ids_path.exists() else {}
    classes = {"wandb": (WandbTracker, reporting.wandb), "mlflow": (MlflowTracker, reporting.mlflow)}
    trackers = []
    try:
        for name in reporting.report_to:
            cls, settings = classes[name]
            trackers.append(cls(run_dir, settings, run_name, config, ids.get(name)))
            ids[name] = trackers[-1].run_id
    except BaseException:
        for t in trackers:
            t.close()
        raise
    if trackers:
        ids_path.write_text(json.dumps(ids, indent=1))
    return trackers

