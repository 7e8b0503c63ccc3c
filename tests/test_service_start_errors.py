"""A service started with bad input stops at once with one line naming it, never a traceback,
and never binds a port other than the one asked for.

Found by a new user's bad-input pass over `python -m env_service` / `python -m reward_service`:

- a second server on a port already served started and *shared* it (gRPC's SO_REUSEPORT): two env
  servers each got part of the calls, so a session opened on one was NOT_FOUND on the other;
- `--port 99999` bound some free port, `--port -1` bound 65535 (gRPC reads the number modulo);
- env_service: an unknown domain was a 60-line traceback after the port was bound; a bad config
  value (`--max-sessions 0`), a `--config` that is a folder, `--log-level BOGUS` and a host that is
  not this machine's were tracebacks;
- reward_service: an unknown `--preload-env` was a traceback after the port was bound; a host that
  is not this machine's a traceback.

Real processes and real gRPC on loopback; nothing here starts an engine or a learner.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    return subprocess.run([sys.executable, "-m", module, *args], check=False, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _one_clear_line(r: subprocess.CompletedProcess, code: int, *words: str) -> str:
    out = r.stdout + r.stderr
    assert r.returncode == code, (r.returncode, out[-3000:])
    assert "Traceback" not in out, out[-3000:]
    for w in words:
        assert w in out, (w, out[-3000:])
    return out


def test_a_server_cannot_share_a_port_already_served():
    """Two `ServiceServer`s on one port: the second fails to bind (BindError, an OSError) and the
    first still answers; a port outside 0–65535 is refused before gRPC can bind another one."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from sinkflex.serving import BindError, ServiceServer

    first = ServiceServer(port=0, service_names=["x.v1.X"])
    port = first.start()
    first.set_serving()
    try:
        second = ServiceServer(port=port, service_names=["x.v1.X"])
        with pytest.raises(BindError, match=f"could not bind 127.0.0.1:{port}: the port is in use"):
            second.start()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        first.stop()
    for bad in (65536, 99999, -1):
        with pytest.raises(ValueError, match=f"port {bad} is not in 0–65535"):
            ServiceServer(port=bad, service_names=["x.v1.X"]).start()


def test_a_second_env_service_on_a_served_port_stops_and_the_first_keeps_its_sessions():
    """Over real gRPC: env server A on port P with an open session; env server B started on P
    exits 1 naming the port (it used to start and take part of P's calls); A's session steps on."""
    from env_service.client import GrpcEnvClient
    from sinkflex.api.common.v1 import common_pb2
    from sinkflex.api.env.v1 import env_pb2
    from sinkflex.serving import wait_for_serving

    port = _free_port()
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    a = subprocess.Popen([sys.executable, "-m", "env_service", "--port", str(port), "--domains", "mock", "--no-metrics",
                          "--log-level", "WARNING"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        with GrpcEnvClient(f"127.0.0.1:{port}", timeout=60) as client:
            wait_for_serving(client.channel, "", timeout=120)
            sid = client.reset(env_pb2.ResetRequest(env="mock", task_id="create_task_1", solo_mode=True)).session_id
            r = _run("env_service", "--port", str(port), "--domains", "mock", "--no-metrics")
            _one_clear_line(r, 1, f"env_service: cannot start: could not bind 127.0.0.1:{port}: the port is in use")
            call = common_pb2.ToolCall(id="c1", name="get_users", arguments_json="{}")
            for _ in range(5):  # every call reaches A, which knows the session
                resp = client.step(env_pb2.StepRequest(session_id=sid, action=common_pb2.Message(
                    role=common_pb2.ROLE_ASSISTANT, tool_calls=[call])))
                assert not resp.terminated and resp.observation[0].tool_call_id == "c1"
    finally:
        a.terminate()
        a.wait(timeout=60)


@pytest.mark.parametrize("args, code, words", [
    (["--domains", "nosuch"], 2, ["env_service: cannot start: unknown tau2 domain 'nosuch'; tau2 ships", "mock"]),
    (["--domains", "mock", "--max-sessions", "0"], 2, ["max_sessions: Input should be greater than or equal to 1"]),
    (["--domains", "mock", "--user-temperature", "5"], 2, ["user_temperature: Input should be less than or equal to 2"]),
    (["--config", "/"], 2, ["env_service: config / is a directory, not a YAML file"]),
    (["--domains", "mock", "--host", "nosuchhost.invalid"], 1, ["env_service: cannot start: could not bind nosuchhost.invalid:"]),
])
def test_env_service_bad_start_is_one_line(args, code, words):
    _one_clear_line(_run("env_service", "--port", "0", "--no-metrics", *args), code, *words)


def test_an_unknown_domain_stops_env_service_before_its_port_is_bound():
    port = _free_port()
    p = subprocess.Popen([sys.executable, "-m", "env_service", "--port", str(port), "--domains", "mock,nosuch", "--no-metrics"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 2 and "unknown tau2 domain 'nosuch'" in out and "listening on" not in out, out[-2000:]


@pytest.mark.parametrize("args, code, words", [
    (["--preload-env", "nosuch"], 2, ["reward_service: cannot start: preload env 'nosuch'", "known envs: airline, mock"]),
    (["--preload-env", "mock", "--host", "nosuchhost.invalid"], 1,
     ["reward_service: cannot start: could not bind nosuchhost.invalid:"]),
])
def test_reward_service_bad_start_is_one_line(args, code, words):
    _one_clear_line(_run("reward_service", "--port", "0", "--no-metrics", *args), code, *words)


@pytest.mark.parametrize("module", ["env_service", "rollout_service", "learner_service"])
@pytest.mark.parametrize("argv, words", [
    (["--port", "99999"], "Invalid value for '--port'"),
    (["--port", "-1"], "Invalid value for '--port'"),
    (["--metrics-port", "70000"], "Invalid value for '--metrics-port'"),
    (["--log-level", "BOGUS"], "'BOGUS' is not one of DEBUG, INFO, WARNING, ERROR"),
])
def test_service_flags_out_of_range_are_usage_errors(module, argv, words, capsys):
    """Parsed without serving (`parse_args`): exit 2 with the flag named; nothing started."""
    import importlib

    main = importlib.import_module(f"{module}.__main__")
    with pytest.raises(SystemExit) as exc:
        main.parse_args(argv)
    assert exc.value.code == 2
    assert words in capsys.readouterr().err
    assert main.parse_args(["--log-level", "warning"]).log_level == "WARNING"


def test_second_reward_service_on_a_served_port_exits_1():
    port = _free_port()
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    a = subprocess.Popen([sys.executable, "-m", "reward_service", "--port", str(port), "--preload-env", "mock", "--no-metrics"],
                         cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        from sinkflex.serving import wait_for_serving

        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            wait_for_serving(ch, "", timeout=120)
        t0 = time.monotonic()
        r = _run("reward_service", "--port", str(port), "--preload-env", "mock", "--no-metrics")
        _one_clear_line(r, 1, f"could not bind 127.0.0.1:{port}: the port is in use")
        assert time.monotonic() - t0 < 60
    finally:
        a.terminate()
        a.wait(timeout=60)
