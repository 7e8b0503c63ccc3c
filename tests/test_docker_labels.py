"""Every image carries the OCI annotations (org.opencontainers.image.*) in its final stage, its
version the project's (pyproject.toml) and its licence the LICENSE's. Parsed with BuildKit's
own parser (the `dockerfile` package); no Docker engine needed."""

from __future__ import annotations

import tomllib

import dockerfile
import pytest

from tests.fixtures.deploy import DOCKER, ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
OCI = "org.opencontainers.image."


def _final_stage(service: str) -> list:
    cmds = dockerfile.parse_file(str(DOCKER / f"{service}.Dockerfile"))
    last_from = max(i for i, c in enumerate(cmds) if c.cmd.upper() == "FROM")
    return cmds[last_from:]


@pytest.mark.parametrize("service", ["env", "reward", "rollout", "learner"])
def test_oci_labels(service):
    stage = _final_stage(service)
    labels = {}
    for c in stage:
        if c.cmd.upper() == "LABEL":
            labels.update({k: v.strip('"') for k, v in zip(c.value[::2], c.value[1::2])})
    args = dict(a.split("=", 1) for c in stage if c.cmd.upper() == "ARG" for a in c.value if "=" in a)
    assert {k[len(OCI):] for k in labels if k.startswith(OCI)} >= {
        "title", "description", "version", "revision", "created", "licenses"}
    assert labels[OCI + "title"] == f"sinkflex-{service}"
    assert labels[OCI + "version"] == "${VERSION}" and args["VERSION"] == PYPROJECT["version"]
    assert labels[OCI + "revision"] == "${REVISION}" and labels[OCI + "created"] == "${CREATED}"
    assert labels[OCI + "licenses"] == PYPROJECT["license"] == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200] and "Version 2.0" in (ROOT / "LICENSE").read_text()[:300]
    assert service in labels[OCI + "description"]
