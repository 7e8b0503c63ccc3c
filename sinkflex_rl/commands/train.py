"""`sinkflex-rl train -c CONFIG`: the main job (see sinkflex_rl/)."""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import time
from pathlib import Path
from typing import Optional

import typer

from sinkflex.service_cli import APP_SETTINGS

app = typer.Typer(**APP_SETTINGS)
log = logging.getLogger("sinkflex_rl.train")


@app.command()
def train(
    config: Path = typer.Option(..., "--config", "-c", help="experiment YAML (configs/)"),
    overrides: Optional[list[str]] = typer.Option(
        None, "--set", metavar="FIELD=VALUE",
        help="override one field, dotted.field=value (value parsed as YAML, checked like the file), "
             "e.g. --set rollout.group_size=8 or --set task.task_ids=[create_task_1]; repeatable, applied in order"),
    steps: Optional[int] = typer.Option(None, help="override run.steps (same as --set run.steps=N, applied last)"),
    output_dir: Optional[str] = typer.Option(None, help="override run.output_dir (applied last)"),
) -> None:
    """Trains a policy with GRPO on tau2-Bench.

    Rollouts → reward → Redis → learner → new policy version. With no service addresses in
    the config, launches every service as a local process on loopback ports and stops them at
    the end or on Ctrl-C; a re-run resumes from the last checkpoint. Writes metrics (JSON
    lines, TensorBoard), plots and a summary to the run folder. Exits 2, naming the dotted
    field, when the config or an override is invalid (`sinkflex-rl config show` prints the
    resolved config without training). A launched process (a service, the rollout's engine, a
    learner rank, the user simulator, the embedded Redis) that dies or stays frozen is restarted
    in-run (local.restart_services, local.max_restarts) and the run goes on from the learner's
    policy version (each recovery a line of recoveries.jsonl); one out of restarts ends the run
    with exit code 3 and one line naming it: re-run the same command to resume. Such a stop leaves `stopped.json` in the run
    folder (that line, the error, the time); the next run in that folder renames it to
    stopped-<UTC time of the stop>.json as it starts, so a run that finishes leaves none.
    Each session (the first run, each resume) is a line of `sessions.jsonl`; summary.json
    gives this session's `wall_seconds` and `groups_published`, and every session's
    `wall_seconds_all_sessions` and `groups_trained`.
    """

    from rich.console import Console

    from tau2_adapter.logs import quiet_tau2_logs

    quiet_tau2_logs()  # before anything imports tau2 (task generation and the warm start do, here)
    from sinkflex.buffer import TrajectoryBuffer
    from sinkflex.config import ConfigError
    from sinkflex.reporting import plot_learning_curves, read_metrics, summary_table
    from sinkflex.tracking import open_trackers
    from sinkflex_rl.clients import connect
    from sinkflex_rl.config import load_train_config
    from sinkflex_rl.controller import Controller, paired_difference, read_validations
    from sinkflex_rl.launcher import (
        LocalLauncher,
        ServiceDied,
        peers_serving,
        run_recovering,
    )
    from sinkflex_rl.local import external_addresses, launch_local, wait_for_running_services

    console = Console()
    errors = Console(stderr=True)

    def fail(text: str, style: str = "red") -> None:  # as written: no rich markup, no wrapping
        errors.print(text, style=style, markup=False, highlight=False, soft_wrap=True)
    try:
        cfg = load_train_config(config, train_overrides(overrides, steps, output_dir))
    except ConfigError as err:
        fail(str(err))
        raise typer.Exit(2) from None
    run_dir = cfg.run.dir()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_experiment(run_dir, cfg)  # what `sinkflex-rl eval --policy <run>/learner/policy/vN` scores with
    except OSError as err:  # a file in the way, a read-only or missing place: before anything starts
        fail(run_folder_error("run.output_dir", run_dir, err))
        raise typer.Exit(2) from None
    set_aside_stopped(run_dir)  # a previous stop's stopped.json does not describe this run
    interrupted = False
    stopped: str | None = None  # a launched process died or froze: its one-line message

    def _terminate(signum, _frame):  # SIGTERM (kill, docker stop, a timeout) stops like Ctrl-C
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _terminate)
    t_start = time.time()
    try:  # W&B / MLflow (logging.report_to) start before any service: a wrong key fails now
        trackers = open_trackers(run_dir, cfg.logging, cfg.run.name, cfg.model_dump(mode="json"))
    except Exception as err:
        fail(f"logging.report_to: could not start {type(err).__name__}: {err}")
        raise typer.Exit(1) from None
    with LocalLauncher(run_dir) as launcher:
        try:
            wait_for_running_services(cfg)  # services.*_address: said while waiting, named when nothing answers
            addresses = external_addresses(cfg) if cfg.services.external() else launch_local(cfg, launcher)
        except BaseException as err:
            for tracker in trackers:
                tracker.close()
            if isinstance(err, ConfigError):
                fail(str(err))
                raise typer.Exit(2) from None
            message = launcher.diagnose() if isinstance(err, Exception) else None
            if message is not None:  # a service died while the others were starting
                fail(message)
                raise typer.Exit(3) from None
            raise
        # task.reward_address: the reward service that scores task.env, not the experiment's
        controller = Controller(cfg, connect(addresses, reward=cfg.task.reward_address),
                                alive_check=launcher.check_alive)
        controller.metrics.add_trackers(trackers)
        try:
            version = run_recovering(controller, launcher, lambda: connect(addresses, reward=cfg.task.reward_address),
                                     wait_for_peers=lambda: launcher.diagnose() is None and peers_serving(addresses))
            log.info("done: policy version %d", version)
        except ConfigError as err:  # e.g. the reward service does not know task.env (checked before any rollout)
            controller.close()
            fail(str(err))
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            interrupted = True
            fail("interrupted: stopping services (the learner checkpoints); re-run to resume", style="yellow")
        except Exception as err:  # noqa: BLE001 - a dead or frozen process is named, not a traceback
            died = err if isinstance(err, ServiceDied) else None
            message = str(err) if died else launcher.diagnose(settle_s=3.0)
            if message is None and launcher.restart_log:  # restarted, but the step failed meanwhile
                message = (f"{str(err).splitlines()[0]} (after: {launcher.restart_log[-1]}, restarted); "
                           "re-run the same command to resume")
            if message is None:
                raise
            controller.close()
            log.debug("stopped by %s: %s", type(err).__name__, err, exc_info=True)
            fail(message)
            (run_dir / "stopped.json").write_text(json.dumps({"message": message, "error": f"{type(err).__name__}: "
                                                              f"{str(err)[:2000]}", "time": time.time()}, indent=1))
            append_session(run_dir, t_start, "stopped")
            stopped = message
        finally:
            controller.close()
        if stopped is not None:  # stop the services (the learner checkpoints) before exiting
            launcher.stop_all()
            raise typer.Exit(3)
    # services are stopped: the learner has checkpointed and acknowledged what it trained
    records = read_metrics(run_dir)
    train_records = [r for r in records if r["kind"] == "train"]
    validations = read_validations(run_dir)
    sessions = append_session(run_dir, t_start, "interrupted" if interrupted else "finished")
    summary = {
        "wall_seconds": round(time.time() - t_start, 1),  # this session (a resumed run: since the re-run)
        "wall_seconds_all_sessions": round(sum(x["wall_seconds"] for x in sessions), 1),
        "sessions": len(sessions),
        "policy_version": int(max((r.get("policy_version", r["step"]) for r in train_records), default=0)),
        "groups_published": controller.groups_published,  # this session
        "recoveries": len(launcher.restart_log),  # in-run restarts of this session (recoveries.jsonl)
        "groups_retried": controller.groups_retried,  # in flight at a failure: rolled out again
        "groups_trained": int(sum(r.get("groups", 0) for r in train_records)),  # every session's train steps
        "interrupted": interrupted,
        "train_steps": len(train_records),
        "last_loss": train_records[-1].get("loss") if train_records else None,
        "max_staleness": cfg.rollout.max_staleness,
        "staleness_max": max((r["staleness_max"] for r in train_records if "staleness_max" in r), default=None),
        "validation": [{k: v.get(k) for k in ("after", "policy_version", "mean_at_1", "ci_low", "ci_high", "tasks", "trials")}
                       for v in validations],
    }
    by_label = {v["after"]: v for v in validations}
    last = validations[-1] if validations else None
    for ref in ("warm_start", "base"):
        if last is not None and ref in by_label and last["after"] != ref:
            summary[f"last_vs_{ref}"] = paired_difference(last, by_label[ref])
    if "warm_start" in by_label and "base" in by_label:
        summary["warm_start_vs_base"] = paired_difference(by_label["warm_start"], by_label["base"])
    plots = plot_learning_curves(records, run_dir / "plots", validations)
    console.print(summary_table(records, title=f"SinkFlex-RL — {cfg.run.name}"))
    if not cfg.services.external():
        import os

        from sinkflex.buffer import embedded_redis_url

        url = cfg.services.redis_url or os.environ.get("REDIS_URL") or embedded_redis_url(path=str(run_dir / "redis" / "buffer.db"))
        stats = TrajectoryBuffer(url=url).stats()
        console.print(f"buffer: {stats}")
        summary["buffer"] = dataclasses.asdict(stats)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    console.print(f"run folder: {run_dir}  plots: {', '.join(p.name for p in plots)}")
    if interrupted:
        raise typer.Exit(130)


def train_overrides(overrides: Optional[list[str]], steps: Optional[int], output_dir: Optional[str]) -> list[str]:
    """`train`'s --set assignments with its --steps and --output-dir after them (applied last;
    the output folder as a YAML string whatever it looks like)."""
    sets = list(overrides or [])
    if steps is not None:
        sets.append(f"run.steps={steps}")
    if output_dir is not None:
        sets.append("run.output_dir=" + json.dumps(output_dir))
    return sets


def run_folder_error(field: str, folder: Path, err: OSError) -> str:
    """The one line that says the run folder `folder` (set by `field`) cannot be created or written."""
    reason = err.strerror or type(err).__name__
    if isinstance(err, (FileExistsError, NotADirectoryError)):
        reason = "a file is in the way (a folder is needed)"
    where = f" ({err.filename})" if err.filename and str(err.filename) != str(folder) else ""
    return (f"{field}: cannot use {folder} as the run folder: {reason}{where}; give a folder that can be "
            "created and written (--output-dir DIR)")


def write_experiment(run_dir: Path, cfg) -> Path:
    """Writes the resolved experiment (`config show`'s YAML: itself an experiment file) to
    ``<run_dir>/experiment.yaml``, the default config of `sinkflex-rl eval` for the run's policies."""
    from sinkflex.config import dump_yaml
    from sinkflex_rl.commands.eval import EXPERIMENT_FILE

    path = run_dir / EXPERIMENT_FILE
    path.write_text(dump_yaml(cfg.model_dump(mode="json"), allow_unicode=True))
    return path


def append_session(run_dir: Path, started: float, outcome: str) -> list[dict]:
    """Appends this session of the run (a `train` command in its run folder: the first, or a
    re-run that resumed) to ``<run_dir>/sessions.jsonl`` and returns every session so far:
    ``{"started": Unix time s, "wall_seconds": s, "outcome": "finished" | "interrupted" |
    "stopped"}``. summary.json sums them (``wall_seconds_all_sessions``); a session that
    ended in an uncaught exception is not recorded. A line that does not parse is skipped."""

    path = run_dir / "sessions.jsonl"
    record = {"started": round(started, 3), "wall_seconds": round(time.time() - started, 1), "outcome": outcome}
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
    sessions = []
    for line in path.read_text().splitlines():
        try:
            sessions.append(json.loads(line))
        except ValueError:
            continue
    return [x for x in sessions if isinstance(x, dict) and isinstance(x.get("wall_seconds"), (int, float))]


def set_aside_stopped(run_dir: Path) -> Path | None:
    """Renames the run folder's ``stopped.json`` (a previous run stopped with an error: its
    message, error and time) to ``stopped-<UTC time of that stop>.json``, so that the folder of a
    run that resumes and finishes does not claim it stopped, while the stop's record is kept.

    Returns:
        the new path, or None when there was no stopped.json.
    """

    path = run_dir / "stopped.json"
    if not path.is_file():
        return None
    try:
        when = time.gmtime(float(json.loads(path.read_text())["time"]))
    except (OSError, ValueError, TypeError, KeyError, OverflowError):  # unreadable or not ours: the file's time
        when = time.gmtime(path.stat().st_mtime)
    name = "stopped-" + time.strftime("%Y%m%dT%H%M%SZ", when)
    target, n = run_dir / f"{name}.json", 1
    while target.exists():
        target, n = run_dir / f"{name}-{n}.json", n + 1
    path.rename(target)
    log.info("the previous run's stopped.json is now %s", target.name)
    return target
