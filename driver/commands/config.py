"""`sinkflex-rl config ...`: the resolved experiment config and its JSON schema."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from sinkflex.service_cli import APP_SETTINGS

app = typer.Typer(help="Show the resolved experiment config or its JSON schema.",
                  no_args_is_help=True, **APP_SETTINGS)

#: What `config show --services` prints for a value that `train` fills in only when it starts.
LAUNCH = "<launch>"

SET_HELP = ("override one field, dotted.field=value (value parsed as YAML), e.g. --set task.task_ids=[create_task_1];"
            " repeatable, applied in order")


@app.command("show")
def show(
    config: Path = typer.Option(..., "--config", "-c", help="experiment YAML (configs/)"),
    overrides: Optional[list[str]] = typer.Option(None, "--set", help=SET_HELP, metavar="FIELD=VALUE"),
    services: bool = typer.Option(False, "--services",
                                  help="print each launched service's own resolved config instead"),
) -> None:
    """Prints the resolved experiment as YAML, as `train` would run it.

    Every job section with its defaults filled in, the service sections as written (they are
    merged over what the job fills in). The output is itself an experiment file that trains
    the same run.

    With --services: the config each locally launched service would get (what `train` writes to
    <run dir>/configs/<service>.yaml), with the values known only at launch (model folders,
    addresses, the Redis URL) shown as <launch>. Exits 2 with the bad field named when the
    config or an override is invalid.
    """
    import yaml

    from driver.config import load_train_config
    from sinkflex.config import ConfigError, describe_source

    overrides = overrides or []
    try:
        cfg = load_train_config(config, overrides)
        if services:
            data: dict[str, Any] = launched_service_configs(cfg)
        else:
            data = cfg.model_dump(mode="json")
    except ConfigError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2) from None
    source = describe_source(config, overrides)
    if services:
        header = (f"# each service's config for {source}, as `sinkflex-rl train` launches it;\n"
                  f"# {LAUNCH}: filled in at start (prepared model folders, addresses, the Redis URL)\n")
        if not data:
            header += "# every service runs already (services.*_address): nothing is launched\n"
    else:
        header = (f"# {source}, resolved: every default filled in; the service sections are\n"
                  "# merged over what the job fills in (`sinkflex-rl config show --services`)\n")
    typer.echo(header + yaml.safe_dump(data, sort_keys=False, allow_unicode=True), nl=False)


@app.command("schema")
def schema() -> None:
    """Prints the JSON schema of an experiment file, for editors.

    JSON Schema draft 2020-12, service sections included (each described by that service's
    own config class); for editors and `check-jsonschema`.
    """
    import json

    from driver.config import experiment_schema

    typer.echo(json.dumps(experiment_schema(), indent=2))


def launched_service_configs(cfg) -> dict[str, Any]:
    """{section: config as a JSON-able dict} of every service `train` would launch locally for
    `cfg`, derived with `driver.config.service_configs` exactly as `driver.local.launch_local`
    does, with `LAUNCH` for what is known only at start. Empty when every service runs already.

    Raises:
        ConfigError: a service section has a bad field (named as `<section>.<field>`).
    """
    from driver.config import service_configs
    from driver.local import demonstrations_path

    if cfg.services.external():
        return {}
    run_dir = cfg.run.dir()
    env_running = cfg.services.env_only()
    addresses = {name: LAUNCH for name in ("env", "reward", "rollout", "learner")}
    if env_running:
        addresses["env"] = cfg.services.env_address
    if not cfg.uses_local_reward_service():
        addresses["reward"] = ""
    task_files = list(cfg.task.task_files)
    if cfg.task.generate is not None:  # driver.local.prepare_task_files writes them there at start
        task_files.append(str(run_dir / "tasks"))
    user_base_url = LAUNCH if (not cfg.task.solo_mode and cfg.models.user_simulator and not env_running) else None
    configs = service_configs(cfg, LAUNCH, addresses, cfg.services.redis_url or LAUNCH, user_base_url,
                              task_files=task_files,
                              demonstrations=str(demonstrations_path(run_dir)) if cfg.warm_start.enabled else None)
    return {name: c.model_dump(mode="json") for name, c in configs.items()}
