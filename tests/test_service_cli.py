"""The four service entry points share `--version` and one metrics flag style.

`python -m env_service|reward_service|rollout_service|learner_service --version` prints the
version `sinkflex-rl --version` prints (pyproject's); every `--help` lists `--no-metrics` and
`--version`; `--no-metrics` and `--metrics-port -1` (the old spelling) mean no metrics,
`--metrics-port N` a port, both together are refused (a usage error, exit 2); the local
launcher says `--no-metrics`. All four are Typer apps; env, rollout and learner also have
`parse_args(argv)` (parse without serving).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from importlib.metadata import version as dist_version
from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ["env_service", "reward_service", "rollout_service", "learner_service"]
#: Services whose `parse_args(argv)` parses without serving, and their default metrics port.
PARSE_ARGS_SERVICES = {"env_service": 9091, "rollout_service": None, "learner_service": 9094}


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    return subprocess.run([sys.executable, "-m", module, *args], check=False, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def cli_version() -> str:
    from sinkflex_rl.cli import app

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    name, version = result.output.split()
    assert name == "sinkflex-rl"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert version == pyproject == dist_version("sinkflex-rl")
    return version


@pytest.mark.parametrize("module", SERVICES)
def test_version_is_sinkflex_rl_version(module, cli_version):
    r = _run(module, "--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [module, cli_version]


@pytest.mark.parametrize("module", SERVICES)
def test_help_lists_no_metrics_and_version(module):
    r = _run(module, "--help")
    assert r.returncode == 0, r.stderr
    for flag in ("--no-metrics", "--metrics-port", "--version"):
        assert flag in r.stdout, (module, flag, r.stdout)


def _parsed_port(module: str, argv: list[str]):
    import importlib

    from sinkflex.service_cli import metrics_port_from

    main = importlib.import_module(f"{module}.__main__")
    return metrics_port_from(main.parse_args(argv))


@pytest.mark.parametrize("module", sorted(PARSE_ARGS_SERVICES))
def test_parse_args_services_metrics_flags(module, capsys):
    assert _parsed_port(module, []) == PARSE_ARGS_SERVICES[module]
    assert _parsed_port(module, ["--no-metrics"]) is None
    assert _parsed_port(module, ["--metrics-port", "-1"]) is None  # the old spelling still works
    assert _parsed_port(module, ["--metrics-port", "0"]) == 0
    assert _parsed_port(module, ["--metrics-port", "9100"]) == 9100
    with pytest.raises(SystemExit) as exc:
        _parsed_port(module, ["--metrics-port", "9100", "--no-metrics"])
    assert exc.value.code == 2
    assert "not allowed with" in capsys.readouterr().err


def test_reward_service_metrics_flags(monkeypatch):
    import reward_service.server
    from reward_service.__main__ import app

    seen = []
    monkeypatch.setattr(reward_service.server, "serve", seen.append)

    def port(*argv: str):
        result = CliRunner().invoke(app, list(argv))
        assert result.exit_code == 0, result.output
        return seen.pop().metrics_port

    assert port() == 9092
    assert port("--no-metrics") is None
    assert port("--metrics-port", "-1") is None  # the old spelling reads as --no-metrics
    assert port("--metrics-port", "9100") == 9100
    refused = CliRunner().invoke(app, ["--metrics-port", "9100", "--no-metrics"])
    assert refused.exit_code == 2 and not seen


def test_local_launcher_uses_no_metrics():
    source = (ROOT / "sinkflex_rl" / "local.py").read_text()
    assert "--metrics-port" not in source
    assert source.count('"--no-metrics"') == 4  # env, reward, rollout, learner


@pytest.mark.parametrize("module", SERVICES)
@pytest.mark.parametrize("order", [("--metrics-port", "9100", "--no-metrics"),
                                   ("--no-metrics", "--metrics-port", "9100")])
def test_both_metrics_flags_are_a_usage_error(module, order):
    r = _run(module, *order)
    assert r.returncode == 2, r.stderr
    assert "Usage: python -m " + module in r.stderr and "not allowed with" in r.stderr, r.stderr


@pytest.mark.parametrize("module", sorted(PARSE_ARGS_SERVICES))
def test_the_typer_app_runs_what_parse_args_parses(module, monkeypatch):
    import importlib

    main = importlib.import_module(f"{module}.__main__")
    seen = []
    monkeypatch.setattr(main, "run", seen.append)
    argv = ["--host", "0.0.0.0", "--port", "0", "--config", "c.yaml", "--no-metrics"]
    result = CliRunner().invoke(main.app, argv)
    assert result.exit_code == 0, result.output
    assert vars(seen.pop()) == vars(main.parse_args(argv))


@pytest.mark.parametrize("module", SERVICES)
def test_dash_h_is_help_too(module):
    r = _run(module, "-h")  # as argparse had it
    assert r.returncode == 0 and "--no-metrics" in r.stdout, r.stderr
