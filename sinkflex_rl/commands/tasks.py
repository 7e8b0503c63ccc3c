"""`sinkflex-rl tasks ...`: generate τ²-Bench task sets, check them by golden replay.

- `tasks generate mock --train N --test M --seed S --out DIR` writes generated mock-domain
  tasks (`tau2_adapter.generate`) as a task dir in τ²-Bench's format and prints the
  counts per family and split.
- `tasks check PATH --env DOMAIN` replays every task's golden actions through the env
  service (in-process by default, or the server at --address, which must serve PATH in its
  `task_files`), scores each with τ²-Bench's evaluator and lists the tasks that do not
  reach 1.0 (exit code 1 if any).

See docs/tasks.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from sinkflex.service_cli import APP_SETTINGS
from sinkflex_rl.commands import check_address, env_client, positive_seconds

#: Most tasks one `tasks generate` writes per split (the generator holds them all in memory).
MAX_TASKS = 100_000

app = typer.Typer(help="Task sets in tau2-Bench's format: generate, check by replay.",
                  no_args_is_help=True, **APP_SETTINGS)


@app.command()
def generate(
    domain: str = typer.Argument(..., help="domain to generate tasks for (mock)"),
    train: int = typer.Option(..., "--train", min=0, max=MAX_TASKS, help="number of train tasks"),
    test: int = typer.Option(..., "--test", min=0, max=MAX_TASKS, help="number of test tasks (held-out users and titles)"),
    seed: int = typer.Option(0, "--seed", help="generator seed (same seed, same tasks)"),
    out: Path = typer.Option(..., "--out", help="task dir to write (tasks.json, split_tasks.json)"),
    force: bool = typer.Option(False, "--force", help="overwrite a task set already in --out"),
) -> None:
    """Generate tasks with splits train and test.

    Of several families: create, status, create_update, forbidden.
    """
    from rich.console import Console
    from rich.table import Table

    from tau2_adapter.generate import (
        FAMILIES,
        generate_mock_tasks,
        summary,
        write_task_dir,
    )

    if domain != "mock":
        typer.secho(f"error: only the mock domain has a generator, got {domain!r}", fg="red", err=True)
        raise typer.Exit(2)
    if out.exists() and not out.is_dir():
        typer.secho(f"error: --out {out} exists and is not a directory", fg="red", err=True)
        raise typer.Exit(2)
    if (out / "tasks.json").exists() and not force:
        typer.secho(f"error: {out} already holds a task set (tasks.json); pass --force to overwrite it", fg="red", err=True)
        raise typer.Exit(2)
    if train + test == 0:
        typer.secho("error: --train and --test are both 0: nothing to generate", fg="red", err=True)
        raise typer.Exit(2)
    task_set = generate_mock_tasks(train, test, seed)
    try:
        write_task_dir(task_set, out)
    except OSError as err:  # a parent that is a file, a read-only or virtual file system, ...
        typer.secho(f"error: cannot write the task set to {out}: {err.strerror or err}", fg="red", err=True)
        raise typer.Exit(2) from None
    counts = summary(task_set)
    table = Table(title=f"{domain} tasks, seed {seed}")
    table.add_column("family")
    for split in counts:
        table.add_column(split, justify="right")
    for family in FAMILIES:
        table.add_row(family, *(str(counts[s].get(family, 0)) for s in counts))
    table.add_row("total", *(str(sum(counts[s].values())) for s in counts), style="bold")
    console = Console(width=100)
    console.print(table)
    console.print(f"wrote {len(task_set)} tasks to {out}")


@app.command()
def check(
    path: Path = typer.Argument(..., help="task dir (tasks.json + split_tasks.json) or a tasks JSON file"),
    env: str = typer.Option(..., "--env", help="tau2 domain the tasks belong to"),
    solo: Optional[bool] = typer.Option(None, "--solo/--no-solo", help="solo mode (default: where the domain supports it)"),
    address: Optional[str] = typer.Option(None, help="env server host:port serving PATH (default: in-process)",
                                          callback=check_address),
    user_model: Optional[str] = typer.Option(None, help="user LLM for non-solo tasks (in-process only)"),
    user_base_url: Optional[str] = typer.Option(None, help="user LLM base URL (in-process only)"),
    ready_timeout: float = typer.Option(10.0, help="seconds to wait for the server at --address to be SERVING",
                                       callback=positive_seconds),
) -> None:
    """Replay golden actions; report tasks that score below 1.0.

    A task whose golden action gets a tool error is reported too (tau2's evaluator replays
    the same failing call for the gold DB, so it would still score 1.0).
    """
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from env_service.replay import replay_golden
    from sinkflex.api.common.v1 import common_pb2
    from sinkflex.errors import ServiceError
    from tau2_adapter.logs import quiet_tau2_logs
    from tau2_adapter.tasks import load_task_dir

    quiet_tau2_logs()
    console = Console(width=120)
    try:
        task_set = load_task_dir(path)
        if not len(task_set):
            raise ValueError(f"{path} holds no tasks: nothing to check")
        client = env_client(env, address, ready_timeout, user_model, user_base_url, task_files=[str(path)])
        if solo is None:
            info = {e.name: e for e in client.list_environments()}
            if env not in info:
                raise ValueError(f"the env server does not serve {env!r} (serves: {', '.join(info)})")
            solo = info[env].supports_solo
    except (ValueError, ServiceError) as err:
        typer.secho(f"error: {err}", fg="red", err=True)
        raise typer.Exit(2) from None

    failed: list[tuple[str, str, str]] = []  # (task id, reward, why)
    with Progress(console=console, transient=True) as progress:
        bar = progress.add_task(f"replaying {len(task_set)} tasks", total=len(task_set))
        for task_id, task in task_set.tasks.items():
            try:
                r = replay_golden(client, env, task_id, solo_mode=solo, task=task)
                errors = [m.content for m in r.messages if m.role == common_pb2.ROLE_TOOL and m.error]
                if r.reward != 1.0:
                    failed.append((task_id, f"{r.reward:g}", f"{r.termination_reason} {r.breakdown}"))
                elif errors:  # tau2 scores a failing golden call against itself: 1.0, but the task is broken
                    failed.append((task_id, f"{r.reward:g}", f"a golden action fails: {errors[0][:200]}"))
            except (ServiceError, ValueError, KeyError) as err:
                failed.append((task_id, "-", f"error: {err}"))
            progress.advance(bar)
    if failed:
        table = Table(title=f"{len(failed)} of {len(task_set)} tasks do not reach reward 1.0")
        for column in ("task", "reward", "why"):
            table.add_column(column)
        for row in failed:
            table.add_row(*row)
        console.print(table)
        raise typer.Exit(1)
    console.print(f"all {len(task_set)} tasks of {path} reach reward 1.0 on golden replay (env {env}, solo={solo})")
