"""Run reporting: metrics to JSON lines and TensorBoard (always), W&B and MLflow (when
configured), learning-curve plots, summaries.

- `MetricsWriter` appends one JSON object per record to `<run_dir>/metrics.jsonl` and
  mirrors scalars to TensorBoard (`<run_dir>/tb`), the formats verl/TRL users expect, and
  to the trackers it is given (`sinkflex.tracking.open_trackers`: W&B through
  `wandb.init`/`run.log`, MLflow through `mlflow.MlflowClient`, TRL's `report_to`;
  `ReportingConfig` is the `logging:` section of an experiment, checked at load). The driver writes `<run>/metrics.jsonl` +
  `<run>/tb/`; the learner, with its run_dir `<run>/learner`, writes `<run>/learner/metrics.jsonl`
  + `<run>/learner/tb/` (its per-optimiser-step curves and the warm start's): both under the
  one run folder, so `tensorboard --logdir <run>` shows them as two runs, `tb` and `learner/tb`.
- `mean_ci` and `pass_hat_k` are the validation statistics: mean@1 with a Student-t
  confidence interval, and τ²-Bench's pass^k (Yao et al., τ-bench, eq. 1: the
  probability that all k i.i.d. trials of a task succeed, estimated per task by
  C(c, k) / C(n, k) with τ²-Bench's own function and averaged over tasks).
- `plot_learning_curves` writes PNGs (matplotlib, Agg backend); `summary_table` renders a
  rich table for the terminal.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from sinkflex.tracking import ReportingConfig, open_trackers  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

JSONL_NAME = "metrics.jsonl"


class MetricsWriter:
    """Writes metric records to `<run_dir>/metrics.jsonl` and TensorBoard.

    A record is `{"kind": str, "step": int, "time": float, <name>: number, ...}`: a Python
    int stays an int (policy versions, counts), anything else becomes a float; `kind`
    ("train", "val", ...) prefixes the TensorBoard tag (`train/reward_mean`).

    `trackers` (`open_trackers`, or `add_trackers` later) get every record too; one that fails
    mid-run is warned about once and skipped, the JSON lines and TensorBoard go on.
    """

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, trackers: Sequence = ()):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / JSONL_NAME
        self.trackers = list(trackers)
        self._failed: set[str] = set()
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tb"))

    def write(self, kind: str, step: int, metrics: Mapping[str, float]) -> dict:
        record = {"kind": kind, "step": int(step), "time": time.time(),
                  **{k: int(v) if isinstance(v, int) else float(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for name, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"{kind}/{name}", value, step)
            self._tb.flush()
        for tracker in self.trackers:
            try:
                tracker.log(kind, int(step), {k: v for k, v in record.items() if k not in ("kind", "step", "time")})
            except Exception:  # a tracker's outage must not stop training; the JSON lines have it all
                if tracker.name not in self._failed:
                    self._failed.add(tracker.name)
                    log.warning("%s: could not log a %s record (step %s); the run goes on, metrics.jsonl has it",
                                tracker.name, kind, step, exc_info=True)
        return record

    def add_trackers(self, trackers: Sequence) -> None:
        """Mirrors every later record to `trackers` as well (closed by `close`)."""
        self.trackers.extend(trackers)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception:
                log.warning("%s: closing failed", tracker.name, exc_info=True)
        self.trackers = []


def read_metrics(run_dir: str | Path) -> list[dict]:
    """All records of `<run_dir>/metrics.jsonl` (an empty list when there is none)."""
    path = Path(run_dir) / JSONL_NAME
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """Mean and a two-sided Student-t confidence interval, as (mean, low, high).

    One value gives a zero-width interval; no values raise ValueError.
    """
    if len(values) == 0:
        raise ValueError("mean_ci of no values")
    from scipy import stats

    n = len(values)
    mean = float(sum(values) / n)
    if n == 1:
        return mean, mean, mean
    sem = stats.sem(values)
    if sem == 0 or not math.isfinite(sem):
        return mean, mean, mean
    half = float(sem * stats.t.ppf((1 + confidence) / 2, n - 1))
    return mean, mean - half, mean + half


def pass_hat_k(successes_per_task: Mapping[str, Sequence[bool]], k: int) -> float:
    """τ²-Bench's pass^k: the mean over tasks of τ²-Bench's own per-task estimate
    (`tau2.metrics.agent_metrics.pass_hat_k`, C(c, k) / C(n, k) for c successes in n trials),
    as τ²-Bench's `compute_metrics` averages it.

    Args:
        successes_per_task: task id -> n trial outcomes (success = reward 1.0, τ²-Bench's
            `is_successful`).
        k: 1 <= k <= n for every task.

    Raises:
        ValueError: no tasks, k < 1, or a task has fewer than k trials (named).
    """
    from tau2.metrics.agent_metrics import pass_hat_k as tau2_pass_hat_k  # imports no LLM client

    if not successes_per_task:
        raise ValueError("pass^k of no tasks")
    scores = []
    for task_id, trials in successes_per_task.items():
        n, c = len(trials), sum(bool(t) for t in trials)
        if k < 1 or n < k:
            raise ValueError(f"pass^{k} needs at least {k} trials of task {task_id}, got {n}")
        scores.append(tau2_pass_hat_k(n, c, k))
    return sum(scores) / len(scores)


def _series(records: Iterable[dict], kind: str, name: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[name]) for r in records if r.get("kind") == kind and name in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_learning_curves(records: list[dict], out_dir: str | Path) -> list[Path]:
    """Writes the learning-curve PNGs of a run; returns their paths.

    - `training_score.png`: mean trajectory reward of each training step's groups
      (± one standard deviation), and the GRPO loss;
    - `trajectory_reward.png`: every trajectory's reward against the step;
    - `validation.png`: validation mean@1 with its confidence interval.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    fig, (ax_r, ax_l) = plt.subplots(1, 2, figsize=(11, 4))
    steps, mean = _series(records, "train", "reward_mean")
    _, std = _series(records, "train", "reward_std")
    if steps:
        ax_r.plot(steps, mean, marker="o", label="reward mean")
        if len(std) == len(mean):
            ax_r.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2, label="± std")
    ax_r.set(title="Training score", xlabel="RL step", ylabel="trajectory reward", ylim=(-0.05, 1.05))
    ax_r.legend(loc="best")
    steps, loss = _series(records, "train", "loss")
    if steps:
        ax_l.plot(steps, loss, marker="o", color="tab:red")
    ax_l.set(title="GRPO loss", xlabel="step", ylabel="loss")
    fig.tight_layout()
    written.append(out_dir / "training_score.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    pts = [(r["step"], r["reward"]) for r in records if r.get("kind") == "trajectory"]
    if pts:
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], alpha=0.5, s=14)
    ax.set(title="Trajectory reward", xlabel="RL step", ylabel="reward", ylim=(-0.05, 1.05))
    fig.tight_layout()
    written.append(out_dir / "trajectory_reward.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    steps, m = _series(records, "val", "mean_at_1")
    _, lo = _series(records, "val", "ci_low")
    _, hi = _series(records, "val", "ci_high")
    if steps:
        ax.plot(steps, m, marker="o", label="mean@1")
        if len(lo) == len(m) == len(hi):
            ax.fill_between(steps, lo, hi, alpha=0.2, label="95% CI")
        ax.legend(loc="best")
    ax.set(title="Validation mean@1 (held-out)", xlabel="policy version", ylabel="τ²-Bench reward", ylim=(-0.05, 1.05))
    fig.tight_layout()
    written.append(out_dir / "validation.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    return written


def summary_table(records: list[dict], title: str = "SinkFlex-RL run"):
    """A rich Table of the training and validation records: one row per RL step, with the
    validation of the policy version that step produced, and first a row for each validation
    of a version no step produced (the base model v0, the warm start).

    Validations are matched by policy version (a "val" record's `policy_version`, else its
    step, which is the version), train rows by the version they produced (`policy_version`;
    a record without one, by its step). A validation no row matches gets a row of its own,
    before the steps or after them.
    """
    from rich.table import Table

    table = Table(title=title)
    cols = [
        ("step", "train", "step"),
        ("version", "train", "policy_version"),
        ("reward mean", "train", "reward_mean"),
        ("loss", "train", "loss"),
        ("kl", "train", "kl"),
        ("clip frac", "train", "clip_fraction"),
        ("tokens/s", "train", "tokens_per_s"),
        ("groups", "train", "groups"),
    ]
    for header, _, _ in cols:
        table.add_column(header, justify="right")
    table.add_column("val mean@1 [95% CI]", justify="right")
    val = {int(r.get("policy_version", r["step"])): r for r in records if r.get("kind") == "val"}
    train = [r for r in records if r.get("kind") == "train"]
    # the version a train row's validation is of: the one it produced (older records: its step)
    keys = [int(r["policy_version"] if r.get("policy_version") is not None else r["step"]) for r in train]

    def val_cell(version):
        v = val.get(version)
        return "-" if v is None else f"{v['mean_at_1']:.3f} [{v['ci_low']:.3f}, {v['ci_high']:.3f}]"

    def val_row(version):
        return ["-", str(version), *["-"] * (len(cols) - 2), val_cell(version)]

    unmatched = sorted(set(val) - set(keys))
    first = min(keys, default=None)
    for version in [v for v in unmatched if first is None or v < first]:
        table.add_row(*val_row(version))
    for r, key in zip(train, keys):
        cells = []
        for _, _, name in cols:
            v = r.get(name)
            cells.append("-" if v is None else (f"{int(v)}" if name in ("step", "groups", "policy_version") else f"{v:.4g}"))
        cells.append(val_cell(key))
        table.add_row(*cells)
    for version in [v for v in unmatched if first is not None and v > first]:
        table.add_row(*val_row(version))
    return table
