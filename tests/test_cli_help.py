"""Every entry point's `--help` renders well at 80 columns.

For the four `python -m <service>` and `sinkflex-rl` with each of its groups and commands,
run for real (COLUMNS=80): exit 0; every flag of the command is listed; every bracketed
literal of its help strings (`[0, 2]`, `[flags]`, `task.task_ids=[create_task_1]`,
`<run dir>`) appears intact (Rich markup used to eat `[flags]` and `[default: ...]`); no
line is cut inside a flag name; no option shows its default twice; every option has a
description. A service's `--help` loads neither torch, vLLM, tau2 nor litellm.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "vllm", "tau2", "litellm")

#: entry point -> (module run with `python -m`, its arguments before --help)
ENTRY_POINTS = {
    "env_service": ("env_service", []),
    "reward_service": ("reward_service", []),
    "rollout_service": ("rollout_service", []),
    "learner_service": ("learner_service", []),
    "sinkflex-rl": ("sinkflex_rl.cli", []),
    **{f"sinkflex-rl {' '.join(c)}": ("sinkflex_rl.cli", list(c)) for c in [
        ("train",), ("tasks",), ("tasks", "generate"), ("tasks", "check"), ("env",), ("env", "serve"),
        ("env", "check"), ("env", "replay"), ("config",), ("config", "show"), ("config", "schema"),
        ("models",), ("models", "prepare"), ("memory",), ("eval",)]},
}

#: A literal each of these helps must show as written (so the check below is not vacuous).
MUST_SHOW = {
    "env_service": ["in [0, 2]", "DOMAIN=PATH[,PATH]"],
    "reward_service": ["in [0, 1]", "ENV=PATH[,PATH]"],
    "rollout_service": ["in [0, 65535]"],
    "learner_service": ["--config FILE [flags]"],
    "sinkflex-rl train": ["task.task_ids=[create_task_1]"],
    "sinkflex-rl config show": ["task.task_ids=[create_task_1]", "<run dir>/configs/<service>.yaml", "<launch>"],
}

_BRACKETED = re.compile(r"\S*\[[^\[\]\n]*\]\S*|\S*<[^<>\n]*>\S*")

_PROBE = """\
import runpy, sys
module = sys.argv[1]
sys.argv = [module, *sys.argv[2:]]
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
except SystemExit as exit:
    code = exit.code
else:
    code = 0
print("\\nLOADED:" + ",".join(m for m in %r if m in sys.modules), file=sys.stderr)
sys.exit(code)
""" % (HEAVY,)


def _command(module: str, args: list[str]):
    """The Click command `python -m module *args --help` describes."""
    app = importlib.import_module(module if module == "sinkflex_rl.cli" else f"{module}.__main__").app
    command = typer.main.get_command(app)
    for name in args:
        command = command.commands[name]
    return command


def _help(module: str, args: list[str]) -> tuple[int, str, str]:
    env = {**os.environ, "COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb"}
    r = subprocess.run([sys.executable, "-c", _PROBE, module, *args, "--help"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120, check=False)
    loaded = r.stderr.rsplit("LOADED:", 1)[-1].strip()
    return r.returncode, r.stdout, loaded


def _flat(text: str) -> str:
    """The help as one line: wrapped lines joined (a wrap after a hyphen joins without a space)."""
    return re.sub(r"\s+", " ", re.sub(r"-\n\s+", "-", text))


def _help_strings(command) -> list[str]:
    strings = [command.help or ""]
    strings += [getattr(p, "help", None) or "" for p in command.params]
    strings += [p.metavar or "" for p in command.params]
    for sub in getattr(command, "commands", {}).values():
        strings.append((sub.help or "").split("\n\n")[0])
    return strings


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_help_renders_well_at_80_columns(entry):
    module, args = ENTRY_POINTS[entry]
    code, text, loaded = _help(module, args)
    assert code == 0, text
    assert max(len(line) for line in text.splitlines()) <= 80, text
    command = _command(module, args)
    flat = _flat(text)
    for param in command.params:
        for flag in [*param.opts, *param.secondary_opts]:
            if flag.startswith("-"):
                assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), (entry, flag, text)
        if isinstance(param, typer.core.TyperOption) and param.name != "help":
            assert param.help, f"{entry}: {param.opts[0]} has no description"
            says_default = "(default:" in param.help
            shows_default = param.default is not None and param.show_default not in (False, None) and not param.is_flag
            assert not (says_default and shows_default), f"{entry}: {param.opts[0]} shows its default twice"
    for sub in getattr(command, "commands", {}):
        assert re.search(rf"^  {re.escape(sub)} ", text, re.M), (entry, sub, text)
    literals = {m for s in _help_strings(command) for m in _BRACKETED.findall(s)}
    for literal in literals | set(MUST_SHOW.get(entry, [])):
        assert literal in flat, f"{entry}: {literal!r} is not shown as written:\n{text}"
    for literal in MUST_SHOW.get(entry, []):
        assert any(literal in s for s in _help_strings(command)), (entry, literal)
    assert "..." not in text.replace("[ARGS]...", ""), f"{entry}: a help line is cut short:\n{text}"
    assert not re.search(r"--[a-z][a-z0-9-]*-\n", text), f"{entry}: a flag name is wrapped:\n{text}"
    if module != "sinkflex_rl.cli":
        assert loaded == "", f"`python -m {module} --help` loaded {loaded}"


def test_one_help_style_for_every_app():
    """Every Typer app of the project is built with the shared settings (no Rich markup)."""
    from sinkflex.service_cli import APP_SETTINGS

    apps = [importlib.import_module(f"{m}.__main__").app
            for m in ("env_service", "reward_service", "rollout_service", "learner_service")]
    apps += [importlib.import_module("sinkflex_rl.cli").app]
    apps += [importlib.import_module(f"sinkflex_rl.commands.{m}").app for m in ("config", "env", "memory", "models", "tasks", "train")]
    assert APP_SETTINGS["rich_markup_mode"] is None
    for app in apps:
        assert app.rich_markup_mode is None, app.info.help
