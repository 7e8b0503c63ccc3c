"""scripts/build_images.sh and scripts/compose_up.py: what they would run, checked without
building an image or starting a container.

- build_images.sh --dry-run: every image docker-compose.yml's CPU stack uses is built, from
  the Dockerfile compose names for it, with only build arguments the Dockerfile declares
  (the Dockerfiles are used as shipped), in Docker format (HEALTHCHECK kept), and the
  requirement lines each image installs come from pyproject.toml.
- compose_up.py: the start order it derives from the real compose file respects every
  depends_on, and compose durations parse as compose reads them.
"""

from __future__ import annotations

import importlib.util
import shlex
import subprocess

import pytest

from tests.fixtures.deploy import ROOT, dockerfile_instructions, interpolate_defaults

SCRIPT = ROOT / "scripts" / "build_images.sh"
#: compose service -> the image build_images.sh names it by
CPU_STACK = {"env": "env", "reward": "reward", "rollout-cpu": "rollout-cpu", "learner-cpu": "learner-cpu"}


def _load_compose_up():
    spec = importlib.util.spec_from_file_location("compose_up", ROOT / "scripts" / "compose_up.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def plan() -> list[list[str]]:
    out = subprocess.run(["bash", str(SCRIPT), "--dry-run"], check=True, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "WHEELS": "/opt/wheels"}, timeout=60)
    return [shlex.split(line) for line in out.stdout.splitlines() if line.strip()]


def _builds(plan: list[list[str]]) -> dict[str, dict]:
    """{tag: {dockerfile, args: {K: V}, volumes, format}} of the plan's `podman build` lines."""
    builds = {}
    for cmd in plan:
        if cmd[:2] != ["podman", "build"]:
            continue
        opts = {"args": {}, "volumes": []}
        it = iter(cmd[2:])
        for word in it:
            if word == "-f":
                opts["dockerfile"] = next(it)
            elif word == "-t":
                opts["tag"] = next(it)
            elif word == "--build-arg":
                k, _, v = next(it).partition("=")
                opts["args"][k] = v
            elif word == "--volume":
                opts["volumes"].append(next(it))
            elif word == "--format":
                opts["format"] = next(it)
            else:
                opts["context"] = word
        builds[opts["tag"]] = opts
    return builds


def test_script_is_valid_bash_and_documents_itself():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)
    out = subprocess.run(["bash", str(SCRIPT), "--help"], check=True, capture_output=True, text=True, timeout=30)
    assert "--configure" in out.stdout and "REDIS_IMAGE" in out.stdout
    bad = subprocess.run(["bash", str(SCRIPT), "nonsense"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "unknown argument 'nonsense'" in bad.stderr


def test_base_images_come_from_debian_packages(plan):
    boots = [c for c in plan if c and c[0] == "debootstrap"]
    assert len(boots) == 2
    python, redis = boots
    assert "--variant=minbase" in python and "bookworm" in python
    assert {"python3.11", "python3.11-venv", "python3-pip", "ca-certificates"} <= set(
        python[python.index("--variant=minbase") + 1].removeprefix("--include=").split(","))
    assert "--include=redis-server" in redis
    imports = [c[-1] for c in plan if c[:2] == ["podman", "import"]]
    assert imports == ["localhost/sinkflex/python:3.11-bookworm", "localhost/sinkflex/redis:7-bookworm"]


def test_every_cpu_stack_image_is_built_from_its_dockerfile_with_declared_args_only(plan, compose):
    builds = _builds(plan)
    for service in CPU_STACK:
        svc = compose["services"][service]
        build = builds.get(svc["image"])
        assert build, f"{service}: build_images.sh does not build {svc['image']}"
        assert build["dockerfile"] == str(ROOT / svc["build"]["dockerfile"])
        assert build["context"] == str(ROOT)
        assert build["format"] == "docker"  # OCI format drops HEALTHCHECK
        # only build arguments change: each is an ARG of that Dockerfile, and compose's own
        # build args (DEVICE=cpu) are the same
        declared = {a.split("=", 1)[0] for i, a in dockerfile_instructions(ROOT / svc["build"]["dockerfile"])
                    if i == "ARG"}
        assert set(build["args"]) <= declared, f"{service}: {set(build['args']) - declared} not declared"
        for k, v in (svc["build"].get("args") or {}).items():
            assert build["args"][k] == v, (service, k)
        assert build["args"]["PYTHON_IMAGE"] == "localhost/sinkflex/python:3.11-bookworm"
        assert build["volumes"] == ["/opt/wheels:/opt/wheels:ro"]
    assert len(builds) == len(CPU_STACK)


def test_redis_image_of_the_script_is_the_one_compose_can_take(plan, compose):
    image = compose["services"]["redis"]["image"]
    assert image.startswith("${REDIS_IMAGE:-") and interpolate_defaults(image) == "redis:7.4-alpine"
    assert [c[-1] for c in plan if c[:2] == ["podman", "import"]][1] == "localhost/sinkflex/redis:7-bookworm"


def test_compose_up_starts_every_service_after_what_it_depends_on(compose):
    compose_up = _load_compose_up()
    enabled = {n: s for n, s in compose["services"].items() if not s.get("profiles") or "cpu" in s["profiles"]}
    order = compose_up.start_order(enabled, ["train-cpu"])
    assert order[-1] == "train-cpu"
    assert set(order) == {"redis", "tasks", "env", "reward", "warm-start-cpu", "user-sim-cpu", "rollout-cpu",
                          "learner-cpu", "train-cpu"}
    for i, name in enumerate(order):
        for dep, cond in compose_up.dependencies(enabled[name]).items():
            assert order.index(dep) < i, (name, dep)
            # the one-shot jobs (the generated tasks, the warm start's demonstrations) are waited for until they exit 0
            assert cond == ("service_completed_successfully" if dep in ("tasks", "warm-start-cpu") else "service_healthy")
    assert order.index("tasks") < order.index("env") and order.index("warm-start-cpu") < order.index("learner-cpu")
    with pytest.raises(ValueError, match="unknown service 'nope'"):
        compose_up.start_order(enabled, ["nope"])
    with pytest.raises(ValueError, match="dependency cycle: a -> b -> a"):
        compose_up.start_order({"a": {"depends_on": ["b"]}, "b": {"depends_on": ["a"]}}, ["a"])


def test_compose_up_names_missing_secret_files_before_starting_anything(compose, tmp_path):
    """The Redis users' files (scripts/redis_acl.py) and the TLS overlay's certificates are checked for every
    service it would start, relative to the compose file's folder, each missing one named with what writes it."""
    import yaml

    compose_up = _load_compose_up()
    tls = yaml.safe_load((ROOT / "docker-compose.tls.yml").read_text())
    services = {n: {**s, "secrets": [*s.get("secrets", []), *tls["services"].get(n, {}).get("secrets", [])]}
                for n, s in compose["services"].items() if not s.get("profiles") or "cpu" in s["profiles"]}
    secrets = {k: {"file": interpolate_defaults(v["file"])} for k, v in {**compose["secrets"], **tls["secrets"]}.items()}
    order = compose_up.start_order(services, ["train-cpu"])
    missing = compose_up.missing_secret_files(services, secrets, order, tmp_path)
    assert "secret redis-users-acl: ./redis-auth/users.acl does not exist; write it with python scripts/redis_acl.py " \
           "redis-auth (or $SINKFLEX_REDIS_AUTH_DIR)" in missing
    assert any(m.startswith("secret sinkflex-tls-driver-key: ./tls/driver.key does not exist; write it with python "
                            "scripts/tls_dev_certs.py tls") for m in missing)
    assert len(missing) == 5 + 11  # Redis' acl file and 4 passwords; the CA and 5 identities' pairs
    spec = importlib.util.spec_from_file_location("redis_acl", ROOT / "scripts" / "redis_acl.py")
    redis_acl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(redis_acl)
    redis_acl.write_acl(tmp_path / "redis-auth")
    missing = compose_up.missing_secret_files(services, secrets, order, tmp_path)
    assert len(missing) == 11 and all("sinkflex-tls-" in m for m in missing)


@pytest.mark.parametrize("value,seconds", [("15s", 15.0), ("1m30s", 90.0), ("500ms", 0.5), ("2h", 7200.0), (5, 5.0),
                                           (None, 30.0)])
def test_compose_durations(value, seconds):
    assert _load_compose_up().duration_s(value, 30.0) == seconds


def test_compose_duration_refuses_what_compose_would():
    with pytest.raises(ValueError, match="not a compose duration"):
        _load_compose_up().duration_s("15 seconds", 30.0)
