"""`sinkflex-rl eval --policy PATH`: one policy scored alone on a task split."""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Optional

import typer

from sinkflex.service_cli import APP_SETTINGS

app = typer.Typer(**APP_SETTINGS)
log = logging.getLogger("sinkflex_rl.eval")

#: The experiment file `train` writes into its run folder (the resolved config it ran).
EXPERIMENT_FILE = "experiment.yaml"


def resolve_policy(policy: str) -> tuple[str, Path | None]:
    """(the policy to serve, the run folder it belongs to or None).

    `policy` is a policy folder (config.json + weights, e.g. ``runs/demo/learner/policy/v9``, a
    published version), a run folder (its newest published version under learner/policy/), or a
    model name `sinkflex.models.resolve_model` knows (smollm2, a Hugging Face hub id): returned as is.

    Raises:
        ValueError: a run folder without a published version, or a folder without config.json.
    """
    from sinkflex.models import check_model_folder

    if not policy.strip():
        raise ValueError("empty: give a policy folder, a run folder or a model name")
    path = Path(policy).expanduser()
    if not path.exists() and policy.startswith(("/", "./", "../", "~", ".\\")):  # a path, never a model name
        raise ValueError(f"no such folder: {policy}")
    if (path / "learner" / "policy").is_dir():
        versions = [p for p in (path / "learner" / "policy").iterdir() if p.is_dir() and re.fullmatch(r"v\d+", p.name)]
        if not versions:
            raise ValueError(f"run folder {path} has no published policy version under learner/policy/")
        path = max(versions, key=lambda p: int(p.name[1:]))
    if not path.exists():
        return policy, None  # a model name: resolved (or refused) where the services start
    folder = check_model_folder(path)
    run_dir = folder.parents[2] if folder.parent.name == "policy" and folder.parent.parent.name == "learner" else None
    return str(folder), run_dir


def evaluate_policy(cfg, clients, policy: str, config: str = "", alive_check=lambda: None) -> dict:
    """Scores the policy the rollout service serves on cfg.task.eval_split, as a training validation
    labelled "eval" (`Controller.validate`: <run dir>/validation/eval.json and τ²-Bench's results
    file validation/tau2/eval.json), and writes <run dir>/summary.json. Closes `clients`.

    Args:
        cfg: the experiment (run.output_dir: where to write; validation.*: tasks, trials, temperature).
        clients: `sinkflex_rl.clients.connect(..., learner_required=False)`.
        policy: the policy's name in the summary and the results file.
        config: the experiment file's path, recorded in the summary.

    Returns:
        the summary: policy, config, env, split, temperature, mean_at_1, ci_low, ci_high,
        pass_hat_1..pass_hat_<trials>, tasks, trials, scored_tasks, unscored, per_family
        ({purpose: tasks, mean_at_1, ci_low, ci_high}), per_task ({task id: rewards}), tau2_results.

    Raises:
        ConfigError: the reward service does not know the env or a task (`Controller.check_reward`).
    """

    from sinkflex_rl.controller import Controller, validation_dir

    controller = Controller(cfg, clients, alive_check=alive_check)
    controller.policy_name = policy
    try:
        controller.check_reward(controller.eval_tasks())
        controller.validate("eval", controller.rollout.status(timeout=60).policy_version)
    finally:
        controller.close()
    out = cfg.run.dir()
    result = json.loads((validation_dir(out) / "eval.json").read_text())
    keys = ["mean_at_1", "ci_low", "ci_high", *sorted((k for k in result if k.startswith("pass_hat_")),
                                                      key=lambda k: int(k.rsplit("_", 1)[1])),
            "tasks", "trials", "scored_tasks", "unscored"]
    summary = {"policy": policy, "config": config, "env": cfg.task.env, "split": cfg.task.eval_split,
               "temperature": cfg.validation.temperature, **{k: result[k] for k in keys},
               "per_family": result["per_purpose"], "per_task": result["per_task"], "tau2_results": result["tau2_results"]}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


@app.command("eval")
def evaluate(
    policy: str = typer.Option(..., "--policy", "-p",
                               help="a policy folder (runs/<run>/learner/policy/vN), a run folder (its newest version), "
                                    "or a model name (smollm2, a hub id)"),
    config: Optional[Path] = typer.Option(None, "--config", "-c",
                                          help=f"experiment YAML (default: the policy's run folder's {EXPERIMENT_FILE})"),
    overrides: Optional[list[str]] = typer.Option(None, "--set", metavar="FIELD=VALUE",
                                                  help="override one field, dotted.field=value (as for train); repeatable"),
    split: Optional[str] = typer.Option(None, "--split", help="task split to score (default: task.eval_split)"),
    num_tasks: Optional[int] = typer.Option(None, "--num-tasks", min=0, help="the first N tasks of the split; 0: all "
                                                                                  "(default: validation.num_tasks)"),
    trials: Optional[int] = typer.Option(None, "--trials", min=1, help="samples per task (default: validation.trials)"),
    temperature: Optional[float] = typer.Option(None, "--temperature", min=0.0,
                                                help="sampling temperature (default: validation.temperature)"),
    output_dir: Optional[Path] = typer.Option(None, "--output-dir", "-o",
                                              help="where to write (default: <run>/eval/<version>-<split> for a run's "
                                                   "policy, else runs/eval/<name>-<split>)"),
) -> None:
    """Scores one policy alone on a task split.

    As validation does during training: starts the env, reward and rollout services (vLLM serving the policy; no learner), samples
    --trials episodes of every task of the split and writes to the output folder:
    summary.json (mean@1 with its 95 % Student-t interval over tasks, pass^k for k = 1..trials,
    per family (τ²-Bench's task purpose) and per task), validation/eval.json, and the
    trajectories as τ²-Bench's results file validation/tau2/eval.json (`tau2 view --file` opens
    it). The experiment (task set, rollout limits, services) is the policy's run's
    experiment.yaml, or --config. Exits 2 on a bad config or policy, 3 when a launched service dies.
    """

    from rich.console import Console
    from rich.table import Table

    from tau2_adapter.logs import quiet_tau2_logs

    quiet_tau2_logs()
    from sinkflex.config import ConfigError
    from sinkflex_rl.clients import connect
    from sinkflex_rl.config import load_train_config
    from sinkflex_rl.commands.train import run_folder_error, write_experiment
    from sinkflex_rl.launcher import LocalLauncher, ServiceDied
    from sinkflex_rl.local import external_addresses, launch_local, wait_for_running_services

    console, errors = Console(), Console(stderr=True)

    def fail(text: str, code: int) -> None:
        errors.print(text, style="red", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(code)

    try:
        served, run_dir = resolve_policy(policy)
    except ValueError as err:
        fail(f"--policy: {err}", 2)
    if config is None:
        if run_dir is None or not (run_dir / EXPERIMENT_FILE).is_file():
            fail(f"--config is needed: {policy} is not in a run folder with an {EXPERIMENT_FILE}", 2)
        config = run_dir / EXPERIMENT_FILE
    sets = list(overrides or [])
    try:
        base = load_train_config(config, sets)
    except ConfigError as err:
        fail(str(err), 2)
    split_given = split is not None
    split = split or base.task.eval_split
    name = Path(served).name if Path(served).exists() else re.sub(r"[^A-Za-z0-9._-]+", "_", served)
    out = output_dir or ((run_dir / "eval" if run_dir else Path("runs") / "eval") / f"{name}-{split}")
    sets += [f"models.policy={json.dumps(served)}", f"run.output_dir={json.dumps(str(out))}", "warm_start.enabled=false",
             f"task.eval_split={json.dumps(split)}"]
    if base.task.generate is not None and run_dir is not None and (run_dir / "tasks" / "tasks.json").is_file():
        # the run's generated tasks, not a regenerated copy
        sets += ["task.generate=null", f"task.task_files={json.dumps([*base.task.task_files, str(run_dir / 'tasks')])}"]
    for field, value in (("num_tasks", num_tasks), ("trials", trials), ("temperature", temperature)):
        if value is not None:
            sets.append(f"validation.{field}={value}")
    try:
        cfg = load_train_config(config, sets)
    except ConfigError as err:
        fail(str(err), 2)
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_experiment(out, cfg)
    except OSError as err:  # a file in the way, a read-only or missing place: before anything starts
        fail(run_folder_error("--output-dir", out, err).replace("(--output-dir DIR)", "(-o DIR)"), 2)
    t0 = time.time()
    with LocalLauncher(out) as launcher:
        try:
            wait_for_running_services(cfg)  # services.*_address: said while waiting, named when nothing answers
            addresses = external_addresses(cfg) if cfg.services.external() else launch_local(cfg, launcher, learner=False)
        except ConfigError as err:  # models.policy is what --policy set, task.eval_split what --split set
            said = str(err)
            for field, flag in (("models.policy: ", "--policy: "), *((("task.eval_split: ", "--split: "),) if split_given else ())):
                if said.startswith(field):
                    said = flag + said[len(field):]
            fail(said, 2)
        except Exception:
            message = launcher.diagnose()
            if message is None:
                raise
            fail(message, 3)
        clients = connect(addresses, reward=cfg.task.reward_address, learner_required=False)
        t_ready = time.time()
        try:
            summary = evaluate_policy(cfg, clients, served, str(config), alive_check=launcher.check_alive)
            episodes_seconds = time.time() - t_ready  # the services up: the episodes and their scores (not their stop)
        except ConfigError as err:
            fail(str(err), 2)
        except Exception as err:
            message = str(err) if isinstance(err, ServiceDied) else launcher.diagnose(settle_s=3.0)
            if message is None:
                raise
            fail(message, 3)
    summary["wall_seconds"] = round(time.time() - t0, 1)
    summary["episodes_seconds"] = round(episodes_seconds, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    result = summary
    table = Table(title=f"{served} on {cfg.task.env}/{split}: {result['tasks']} tasks x {result['trials']} trials")
    for col in ("family", "tasks", "mean@1 [95% CI]"):
        table.add_column(col, justify="left" if col == "family" else "right")
    for family, s in result["per_family"].items():
        table.add_row(family or "(no purpose)", str(s["tasks"]), f"{s['mean_at_1']:.3f} [{s['ci_low']:.3f}, {s['ci_high']:.3f}]")
    table.add_row("all", str(result["tasks"]), f"{result['mean_at_1']:.3f} [{result['ci_low']:.3f}, {result['ci_high']:.3f}]",
                  style="bold")
    console.print(table)
    console.print("  ".join([f"mean@1 {result['mean_at_1']:.3f} [{result['ci_low']:.3f}, {result['ci_high']:.3f}]",
                             *(f"pass^{k[len('pass_hat_'):]} {v:.3f}" for k, v in result.items() if k.startswith("pass_hat_"))]),
                  soft_wrap=True)
    console.print(f"summary: {out / 'summary.json'}  τ²-Bench results: {result['tau2_results']}", soft_wrap=True)
