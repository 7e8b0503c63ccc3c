"""`sinkflex-rl env ...`: serve tau2 domains, check any env server, replay golden actions."""

from __future__ import annotations

from typing import Optional

import typer

from sinkflex.service_cli import APP_SETTINGS
from sinkflex_rl.commands import check_address, env_client, positive_seconds

app = typer.Typer(help="The env service: serve, check conformance, replay golden actions.",
                  no_args_is_help=True, **APP_SETTINGS)


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="address to bind"),
    port: int = typer.Option(50051, help="gRPC port, 0: any free port"),
    user_model: Optional[str] = typer.Option(None, help='litellm model of the user simulator, e.g. "openai/smollm2"'),
    user_base_url: Optional[str] = typer.Option(None, help="OpenAI-compatible base URL of the user LLM"),
    max_sessions: Optional[int] = typer.Option(None, help="open sessions at most (default: 1024)"),
) -> None:
    """Serve every tau2 domain over gRPC.

    The same as `python -m env_service` with these flags (see its --help for all of them).
    """
    from env_service.__main__ import main

    argv = ["--host", host, "--port", str(port)]
    for flag, value in (("--user-model", user_model), ("--user-base-url", user_base_url), ("--max-sessions", max_sessions)):
        if value is not None:
            argv += [flag, str(value)]
    main(argv)


@app.command()
def check(
    address: str = typer.Argument(..., help="host:port of any EnvService server", callback=check_address),
    env: Optional[str] = typer.Option(None, help="environment to run episodes on (default: the first listed)"),
    task: Optional[str] = typer.Option(None, help="task to run (default: the env's first task)"),
    solo: Optional[bool] = typer.Option(None, "--solo/--no-solo", help="solo mode (default: where the env supports it)"),
    timeout: float = typer.Option(120.0, help="seconds per call", callback=positive_seconds),
    ready_timeout: float = typer.Option(5.0, help="seconds for the server to accept a connection and be SERVING",
                                       callback=positive_seconds),
    concurrency: int = typer.Option(6, min=2, help="sessions the concurrency check runs at once"),
    max_sessions: Optional[int] = typer.Option(None, min=1, help="the server's session limit: also check Reset beyond it"),
) -> None:
    """Run the conformance suite against an env server.

    Prints what passes and fails. Exit code 0: every check passed; 1: some failed; 2: nothing reachable at ADDRESS.
    """
    from env_service.conformance import EnvUnreachable, format_results, run_checks

    try:
        results = run_checks(address, env=env, task_id=task, solo=solo, timeout=timeout, ready_timeout=ready_timeout,
                             concurrency=concurrency, max_sessions=max_sessions)
    except EnvUnreachable as err:
        typer.secho(f"error: {err}", fg="red", err=True)
        raise typer.Exit(2) from None
    typer.echo(format_results(results))
    if not all(r.passed for r in results):
        raise typer.Exit(1)


@app.command()
def replay(
    env: str = typer.Option(..., "--env", help="tau2 domain"),
    task: str = typer.Option(..., "--task", help="task id"),
    address: Optional[str] = typer.Option(None, help="env server host:port (default: in-process)", callback=check_address),
    solo: bool = typer.Option(False, "--solo", help="solo mode (mock, telecom)"),
    user_model: Optional[str] = typer.Option(None, help="user LLM (in-process only)"),
    user_base_url: Optional[str] = typer.Option(None, help="user LLM base URL (in-process only)"),
    show: bool = typer.Option(False, "--show", help="print the trajectory"),
    ready_timeout: float = typer.Option(10.0, help="seconds to wait for the server at --address to be SERVING",
                                       callback=positive_seconds),
) -> None:
    """Replay a task's golden actions and print the final reward.

    The actions go through the env service; the reward is tau2's evaluator
    (`evaluate_simulation`: DB, ENV_ASSERTION, ACTION, COMMUNICATE) on the trajectory the
    service produced. The server's own reward is shown too.
    """
    from tau2_adapter.logs import quiet_tau2_logs

    quiet_tau2_logs()
    from env_service.replay import replay_golden
    from sinkflex.errors import ServiceError

    try:
        client = env_client(env, address, ready_timeout, user_model, user_base_url)  # ValueError: unknown domain
        result = replay_golden(client, env, task, solo_mode=solo)
    except (ServiceError, KeyError, ValueError) as err:
        msg = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        hint = ""
        if isinstance(err, ServiceError) and "user simulator" in err.message:
            hint = ("\nthis task needs a user simulator: an OpenAI-compatible endpoint (--user-base-url, "
                    "default http://127.0.0.1:8000/v1), or a solo task, e.g. --env mock --task create_task_1 --solo")
        typer.secho(f"error: {msg}{hint}", fg="red", err=True)
        raise typer.Exit(2) from None
    if show:
        from google.protobuf import text_format

        for m in result.messages:
            typer.echo(text_format.MessageToString(m, as_one_line=True))
    typer.echo(f"env={env} task={task} steps={result.num_steps} termination={result.termination_reason} "
               f"server_reward={result.server_reward:g}")
    typer.echo(f"reward={result.reward:g} breakdown={result.breakdown}")
