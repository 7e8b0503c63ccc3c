"""The import rules of the layout (docs/architecture.md): the foundation `sinkflex` imports no
service and not the driver (`sinkflex_rl`); services import the foundation, never the driver; the driver
sits above everything. Checked on the source with `ast`, so lazy imports inside functions
count too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("env_service", "reward_service", "rollout_service", "learner_service")
DRIVER = "sinkflex_rl"  # the driver: the layer above the services


def imported_top_levels(package: str) -> dict[str, set[str]]:
    """{module path: top-level packages it imports} for every .py file of `package`."""
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        if "api" in path.relative_to(ROOT / package).parts[:1] and package == "sinkflex":
            continue  # generated stubs import only grpc/protobuf and each other
        tops: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                tops.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops.add(node.module.split(".")[0])
        out[str(path.relative_to(ROOT))] = tops
    return out


def test_foundation_imports_no_service_and_no_driver():
    bad = {m: sorted(t & {*SERVICES, DRIVER}) for m, t in imported_top_levels("sinkflex").items()}
    bad = {m: t for m, t in bad.items() if t}
    assert not bad, f"sinkflex/ (the foundation) must not import services or the driver: {bad}"


@pytest.mark.parametrize("service", SERVICES)
def test_services_never_import_the_driver(service):
    bad = {m: DRIVER for m, t in imported_top_levels(service).items() if DRIVER in t}
    assert not bad, f"{service} imports the driver: {bad}"


def test_no_generic_top_level_package():
    """The installed top-level packages are the project's own names: no `driver` or other generic
    name that collides in a user's environment."""
    import tomllib
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    tops = {i.rstrip("*") for i in include}
    assert tops == {"sinkflex", "sinkflex_rl", "tau2_adapter", *SERVICES}, tops
    assert not (ROOT / "driver").exists()
