"""`sinkflex-rl config ...`: the resolved experiment config and its JSON schema."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from sinkflex.service_cli import APP_SETTINGS

app = typer.Typer(help="Show the resolved experiment config or its JSON schema.",
                  no_args_is_help=True, **APP_SETTINGS)

SET_HELP = ("override one field, dotted.field=value (value parsed as YAML), e.g. --set task.task_ids=[create_task_1];"
            " repeatable, applied in order")


@app.command("show")
def show(
    config: Path = typer.Option(..., "--config", "-c", help="experiment YAML (configs/)"),
    overrides: Optional[list[str]] = typer.Option(None, "--set", help=SET_HELP, metavar="FIELD=VALUE"),
    services: bool = typer.Option(False, "--services",
                                  help="print each launched service's own resolved config instead"),
    steps: Optional[int] = typer.Option(None, help="override run.steps (as `train --steps`, applied last)"),
    output_dir: Optional[str] = typer.Option(None, help="override run.output_dir (as `train --output-dir`, applied last)"),
) -> None:
    """Prints the resolved experiment as YAML, as `train` would run it.

    Every job section with its defaults filled in, the service sections as written (they are
    merged over what the job fills in). The output is itself an experiment file that trains
    the same run.

    With --services: the config each locally launched service would get (what `train` writes to
    <run dir>/configs/<service>.yaml), with the values known only at launch (model folders,
    addresses, the Redis URL) shown as <launch>. Exits 2 with the bad field named when the
    config or an override is invalid. --steps and --output-dir are `train`'s, so `train`'s own
    arguments check a run before it starts (bin/demo-dual does, before its user-simulator warm start).
    """
    from sinkflex.config import ConfigError, describe_source, dump_yaml
    from sinkflex_rl.config import LAUNCH, load_train_config

    from sinkflex_rl.commands.train import train_overrides

    overrides = train_overrides(overrides, steps, output_dir)
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
        header = (f"# {source}, resolved: the job sections with every default filled in; the service\n"
                  "# sections as written, merged at launch over what the job fills in (their resolved\n"
                  "# values: `sinkflex-rl config show --services`)\n")
    typer.echo(header + dump_yaml(data, allow_unicode=True), nl=False)


@app.command("schema")
def schema() -> None:
    """Prints the JSON schema of an experiment file, for editors.

    JSON Schema draft 2020-12, service sections included (each described by that service's
    own config class); for editors and `check-jsonschema`.
    """

    from sinkflex_rl.config import experiment_schema

    typer.echo(json.dumps(experiment_schema(), indent=2))


def launched_service_configs(cfg) -> dict[str, Any]:
    """{section: config as a JSON-able dict} of every service `train` would launch locally for
    `cfg`: its typed service sections, resolved at load by `sinkflex_rl.config.service_configs` as
    `sinkflex_rl.local.launch_local` does, with `sinkflex_rl.config.LAUNCH` for what is known only at
    start. Empty when every service runs already.
    """
    from sinkflex_rl.config import SERVICE_SECTIONS

    if cfg.services.external():
        return {}

    return {name: getattr(cfg, name).model_dump(mode="json") for name in SERVICE_SECTIONS if getattr(cfg, name) is not None}
