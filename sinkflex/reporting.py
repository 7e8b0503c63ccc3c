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
- `mean_ci`, `paired_ci` and `pass_hat_k` are the validation statistics: mean@1 with a Student-t
  confidence interval, a paired difference with the paired t interval (scipy.stats), and τ²-Bench's pass^k (Yao et al., τ-bench, eq. 1: the
  probability that all k i.i.d. trials of a task succeed, estimated per task by
  C(c, k) / C(n, k) with τ²-Bench's own function and averaged over tasks).
- `plot_learning_curves` writes PNGs (matplotlib, Agg backend) against the RL step; `summary_table`
  renders a rich table for the terminal.
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
        with open(self.path, "a+b") as f:  # after a line cut short by a kill, start a new line (read_metrics skips the cut one)
            f.seek(0, 2)
            cut = False
            if f.tell():
                f.seek(-1, 2)
                cut = f.read(1) != b"\n"
            f.write((("\n" if cut else "") + json.dumps(record) + "\n").encode())
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
    """All records of `<run_dir>/metrics.jsonl` (an empty list when there is none).

    A line that is not a JSON object (a record cut short when its writer was killed or the disk
    filled) is skipped with a warning naming its line numbers, so that such a run folder still
    resumes and summarises."""
    path = Path(run_dir) / JSONL_NAME
    if not path.exists():
        return []
    records, bad = [], []
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and "kind" in record:
            records.append(record)
        else:
            bad.append(n)
    if bad:
        log.warning("%s: skipped %d line(s) that are not records (cut short?): line %s", path, len(bad),
                    ", ".join(map(str, bad[:10])) + (" …" if len(bad) > 10 else ""))
    return records


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """Mean and its two-sided Student-t confidence interval, as (mean, low, high): the interval
    of `scipy.stats.ttest_1samp`. One value, or values all equal, give a zero-width interval;
    no values raise ValueError.
    """
    if len(values) == 0:
        raise ValueError("mean_ci of no values")
    from scipy import stats

    mean = float(sum(values) / len(values))
    if len(values) == 1 or min(values) == max(values):  # no spread: scipy would warn and return NaN or the mean
        return mean, mean, mean
    ci = stats.ttest_1samp(values, 0.0).confidence_interval(confidence)
    return mean, float(ci.low), float(ci.high)


def paired_ci(after: Sequence[float], before: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """Mean of the paired differences `after[i] − before[i]` and its two-sided confidence interval
    from the paired Student-t test (`scipy.stats.ttest_rel`), as (mean, low, high). Differences all
    equal give a zero-width interval.

    Raises:
        ValueError: no pairs, or sequences of different lengths.
    """
    if len(after) != len(before) or not after:
        raise ValueError(f"paired_ci needs pairs: got {len(after)} and {len(before)} values")
    from scipy import stats

    diffs = [a - b for a, b in zip(after, before)]
    mean = float(sum(diffs) / len(diffs))
    if min(diffs) == max(diffs):
        return mean, mean, mean
    ci = stats.ttest_rel(after, before).confidence_interval(confidence)
    return mean, float(ci.low), float(ci.high)


def rate_ci(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float, float]:
    """A success rate and its Wilson score interval (`scipy.stats.binomtest(...).proportion_ci`,
    method "wilson"), as (rate, low, high), all in [0, 1]: the interval for 0/1 outcomes
    (τ²-Bench's success: reward 1.0).

    Raises:
        ValueError: trials < 1 or successes outside 0..trials.
    """
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"rate_ci: {successes} successes in {trials} trials")
    from scipy import stats

    ci = stats.binomtest(int(successes), int(trials)).proportion_ci(confidence, method="wilson")
    return successes / trials, float(ci.low), float(ci.high)


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
    from tau2.metrics.agent_metrics import (
        pass_hat_k as tau2_pass_hat_k,  # imports no LLM client
    )

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


def _version_offset(records: Sequence[dict]) -> int:
    """policy version − RL step of the run's train records (1 after a warm start, else 0)."""
    for r in records:
        if r.get("kind") == "train" and r.get("policy_version") is not None:
            return int(r["policy_version"]) - int(r["step"])
    return 0


def rl_step_of(validation: Mapping, offset: int) -> int:
    """The RL step a validation record (or validation file) belongs to: its `rl_step`, else its
    policy version − `offset` (−1: the base model before a warm start; 0: the policy RL starts from)."""
    if validation.get("rl_step") is not None:
        return int(validation["rl_step"])
    return int(validation.get("policy_version", validation.get("step", 0))) - offset


def reward_interval(rewards: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high) of trajectory rewards in [0, 1]: the Wilson interval of the success rate
    (`rate_ci`) when every reward is 0 or 1, else the Student-t interval (`mean_ci`) clipped to [0, 1]."""
    if all(r in (0.0, 1.0) for r in rewards):
        return rate_ci(int(sum(rewards)), len(rewards), confidence)
    m, lo, hi = mean_ci(rewards, confidence)
    return m, max(0.0, lo), min(1.0, hi)


def _trajectory_rewards(records: Iterable[dict]) -> dict[int, list[float]]:
    """RL step -> the scored rewards of its trajectory records (NaN: unscored, left out)."""
    by: dict[int, list[float]] = {}
    for r in records:
        if r.get("kind") == "trajectory" and isinstance(r.get("reward"), (int, float)) and math.isfinite(r["reward"]):
            by.setdefault(int(r["step"]), []).append(float(r["reward"]))
    return dict(sorted(by.items()))


def _short(label: str, width: int = 48) -> str:
    return label if len(label) <= width else label[: width - 1] + "…"


def plot_learning_curves(records: list[dict], out_dir: str | Path, validations: Sequence[Mapping] = ()) -> list[Path]:
    """Writes the learning-curve PNGs of a run; returns their paths. Every x-axis is the RL step
    (validations at their `rl_step_of`: −1 the base model before a warm start, 0 the policy RL
    starts from).

    - `training_score.png`: each step's mean trajectory reward with its 95 % interval
      (`reward_interval`: Wilson for 0/1 rewards, inside [0, 1]), and the GRPO loss;
    - `trajectory_reward.png`: the share of each step's trajectories that succeeded (reward 1),
      partly succeeded (0 < reward < 1), failed (0) or went unscored, stacked, with the count;
    - `validation.png`: validation mean@1 with its 95 % interval, and pass^k for k = 1..trials;
    - `validation_families.png`: mean@1 per task family (τ²-Bench's ``description.purpose``,
      from `validations`, the run's validation files: `per_purpose`) with their intervals;
    - `learner.png`: the policy's entropy and the KL to the reference per step (learner records).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    offset = _version_offset(records)

    def save(fig, name: str) -> None:
        fig.tight_layout()
        written.append(out_dir / name)
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)

    by_step = _trajectory_rewards(records)
    fig, (ax_r, ax_l) = plt.subplots(1, 2, figsize=(11, 4))
    if by_step:
        steps = list(by_step)
        stats = [reward_interval(v) for v in by_step.values()]
        ax_r.plot(steps, [x[0] for x in stats], marker="o", label="reward mean")
        ax_r.fill_between(steps, [x[1] for x in stats], [x[2] for x in stats], alpha=0.2, label="95% interval")
        ax_r.legend(loc="best")
    else:  # a run without trajectory records: the train records' means
        steps, mean = _series(records, "train", "reward_mean")
        if steps:
            ax_r.plot(steps, mean, marker="o", label="reward mean")
            ax_r.legend(loc="best")
    ax_r.set(title="Training score", xlabel="RL step", ylabel="trajectory reward", ylim=(-0.05, 1.05))
    steps, loss = _series(records, "train", "loss")
    if steps:
        ax_l.plot(steps, loss, marker="o", color="tab:red")
    ax_l.set(title="GRPO loss", xlabel="RL step", ylabel="loss")
    save(fig, "training_score.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    counts = {}
    for r in records:
        if r.get("kind") == "trajectory" and "reward" in r:
            x, c = r["reward"], counts.setdefault(int(r["step"]), [0, 0, 0, 0])
            c[3 if not math.isfinite(x) else 0 if x >= 1.0 else 2 if x <= 0.0 else 1] += 1
    if counts:
        steps = sorted(counts)
        bottom = [0.0] * len(steps)
        for i, (name, color) in enumerate([("success (1)", "tab:green"), ("partial", "tab:olive"),
                                           ("failure (0)", "tab:red"), ("unscored", "tab:gray")]):
            share = [counts[s][i] / sum(counts[s]) for s in steps]
            if any(share):
                ax.bar(steps, share, bottom=bottom, color=color, label=name, width=0.8)
            bottom = [b + x for b, x in zip(bottom, share)]
        for s in steps:
            ax.text(s, 1.01, f"n={sum(counts[s])}", ha="center", va="bottom", fontsize=7)
        ax.legend(loc="lower right", fontsize=8)
    ax.set(title="Trajectory outcomes per step", xlabel="RL step", ylabel="share of trajectories", ylim=(0, 1.1))
    save(fig, "trajectory_reward.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    vals = sorted((r for r in records if r.get("kind") == "val" and "mean_at_1" in r), key=lambda r: rl_step_of(r, offset))
    if vals:
        xs = [rl_step_of(r, offset) for r in vals]
        ax.plot(xs, [r["mean_at_1"] for r in vals], marker="o", label="mean@1")
        if all("ci_low" in r and "ci_high" in r for r in vals):
            ax.fill_between(xs, [r["ci_low"] for r in vals], [r["ci_high"] for r in vals], alpha=0.2, label="mean@1 95% CI")
        for k in range(2, max(int(r.get("trials", 1)) for r in vals) + 1):
            pts = [(x, r[f"pass_hat_{k}"]) for x, r in zip(xs, vals) if isinstance(r.get(f"pass_hat_{k}"), (int, float))]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="s", linestyle="--", label=f"pass^{k}")
        ax.legend(loc="best")
    ax.set(title="Validation (held-out)", xlabel="RL step", ylabel="τ²-Bench reward", ylim=(-0.05, 1.05))
    save(fig, "validation.png")

    fig, ax = plt.subplots(figsize=(9, 4.5))
    families: dict[str, list[tuple[int, dict]]] = {}
    for v in validations:
        for family, score in (v.get("per_purpose") or {}).items():
            families.setdefault(family, []).append((rl_step_of(v, offset), score))
    for family, pts in sorted(families.items()):
        pts.sort(key=lambda p: p[0])
        xs = [p[0] for p in pts]
        line = ax.plot(xs, [p[1]["mean_at_1"] for p in pts], marker="o", label=_short(family or "(no purpose)"))[0]
        if all("ci_low" in p[1] for p in pts):
            ax.fill_between(xs, [p[1]["ci_low"] for p in pts], [p[1]["ci_high"] for p in pts], alpha=0.1,
                            color=line.get_color())
    if families:
        ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7)
    ax.set(title="Validation mean@1 per task family", xlabel="RL step", ylabel="τ²-Bench reward", ylim=(-0.05, 1.05))
    save(fig, "validation_families.png")

    fig, (ax_e, ax_k) = plt.subplots(1, 2, figsize=(11, 4))
    for ax, name, color in ((ax_e, "entropy", "tab:purple"), (ax_k, "kl", "tab:brown")):
        steps, values = _series(records, "train", name)
        pts = [(x, y) for x, y in zip(steps, values) if math.isfinite(y)]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color)
    ax_e.set(title="Policy entropy (per token)", xlabel="RL step", ylabel="nats")
    ax_k.set(title="KL to the reference policy", xlabel="RL step", ylabel="KL")
    save(fig, "learner.png")
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
