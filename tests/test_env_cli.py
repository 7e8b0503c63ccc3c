"""The CLI (`sinkflex-rl env check / replay`), `python -m env_service`, and the external
example environment (examples/bookshop), each as a real process on loopback."""

import ast
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import gymnasium as gym
import pytest
from typer.testing import CliRunner

import env_service
from sinkflex_rl.cli import app

ROOT = Path(__file__).resolve().parents[1]
BOOKSHOP = ROOT / "examples" / "bookshop" / "server.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def bookshop():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(BOOKSHOP), "--port", str(port)], cwd=ROOT)
    yield f"127.0.0.1:{port}"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_example_imports_only_the_contract():
    tree = ast.parse(BOOKSHOP.read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    ours = {m for m in modules if m.split(".")[0] in ("sinkflex", "env_service", "tau2")}
    assert ours == {"sinkflex.api.common.v1", "sinkflex.api.env.v1"}


def test_example_env_passes_env_check(bookshop):
    result = CliRunner().invoke(app, ["env", "check", bookshop, "--timeout", "30", "--max-sessions", "256"])
    assert result.exit_code == 0, result.output
    assert "16/16 checks passed" in result.output
    assert not [line for line in result.output.splitlines() if line.startswith("FAIL")]


def test_example_env_through_remote_gym(bookshop):
    env = gym.make(env_service.REMOTE_TAU2_ENV_ID, address=bookshop, env="bookshop", task_id="swap")
    obs, info = env.reset(seed=0)
    assert obs[0]["role"] == "user" and "Emma" in obs[0]["content"]
    for book, tool in (("b4", "return_book"), ("b2", "lend_book")):
        obs, reward, terminated, _, _ = env.step({"tool_calls": [{"id": tool, "name": tool, "arguments": {"member_id": "m2", "book_id": book}}]})
        assert not obs[0]["error"] and not terminated
    assert env.step({"stop": True})[1:3] == (1.0, True)
    env.reset(seed=0)
    env.step({"tool_calls": [{"id": "x", "name": "lend_book", "arguments": {"member_id": "m2", "book_id": "b1"}}]})  # wrong book
    assert env.step({"stop": True})[1:3] == (0.0, True)
    env.close()


def test_check_unreachable_fails_fast_and_clearly():
    """Nothing listens on the port: no check runs, the error says why, within --ready-timeout
    (5 s by default), whatever the per-call --timeout."""
    port = _free_port()
    t0 = time.monotonic()
    result = CliRunner().invoke(app, ["env", "check", f"127.0.0.1:{port}"])
    elapsed = time.monotonic() - t0
    assert result.exit_code == 2 and elapsed < 10, (elapsed, result.output)
    assert f"error: no env server reachable at 127.0.0.1:{port} within 5 s" in result.output
    assert "Connection refused" in result.output and "is it running" in result.output
    assert "PASS" not in result.output and "RpcError" not in result.output and "<_" not in result.output


def test_python_m_env_service_check_replay_and_sigterm(tmp_path):
    """`python -m env_service` serves, passes the conformance suite, replays a golden
    episode over gRPC, and stops gracefully on SIGTERM."""
    port, metrics_port = _free_port(), _free_port()
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    proc = subprocess.Popen([sys.executable, "-m", "env_service", "--port", str(port), "--domains", "mock",
                             "--max-sessions", "8", "--session-ttl", "60", "--metrics-port", str(metrics_port)], cwd=ROOT, env=env)
    try:
        address = f"127.0.0.1:{port}"
        check = CliRunner().invoke(app, ["env", "check", address, "--timeout", "120", "--ready-timeout", "120",
                                         "--max-sessions", "8"])
        assert check.exit_code == 0, check.output
        assert "16/16 checks passed" in check.output
        replay = CliRunner().invoke(app, ["env", "replay", "--env", "mock", "--task", "create_task_1", "--solo", "--address", address])
        assert replay.exit_code == 0, replay.output
        assert "termination=agent_stop server_reward=1" in replay.output and "reward=1 " in replay.output
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        assert 'sinkflex_sessions{sinkflex_service="env"} 0.0' in metrics  # every session was closed
        assert 'grpc_method="Reset"' in metrics and 'grpc_code="NOT_FOUND"' in metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def test_replay_in_process_wrong_task():
    result = CliRunner().invoke(app, ["env", "replay", "--env", "mock", "--task", "update_task_1", "--solo"])
    assert result.exit_code == 0, result.output
    assert "reward=1 " in result.output


def test_replay_of_an_unreachable_server_or_an_unknown_domain_fails_in_one_line():
    """`env replay --address` with nothing listening gives up after --ready-timeout (it used to
    wait forever); an unknown domain in-process is one error line, not a traceback."""
    port = _free_port()
    t0 = time.monotonic()
    result = CliRunner().invoke(app, ["env", "replay", "--env", "mock", "--task", "create_task_1", "--solo",
                                      "--address", f"127.0.0.1:{port}", "--ready-timeout", "2"])
    assert result.exit_code == 2 and time.monotonic() - t0 < 30, result.output
    assert f"error: no env server SERVING at 127.0.0.1:{port} within 2 s" in result.output
    result = CliRunner().invoke(app, ["env", "replay", "--env", "nosuch", "--task", "x", "--solo"])
    assert result.exit_code == 2 and "error: unknown tau2 domain 'nosuch'" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("address", ["127.0.0.1:99999", "127.0.0.1:0", "127.0.0.1", "127.0.0.1:http", ":50051"])
def test_a_bad_address_is_a_usage_error(address):
    """`env check` / `env replay --address` / `tasks check --address` reject a malformed host:port at once (exit 2)."""
    for argv in (["env", "check", address], ["env", "replay", "--env", "mock", "--task", "create_task_1", "--address", address],
                 ["tasks", "check", "x", "--env", "mock", "--address", address]):
        result = CliRunner().invoke(app, argv)
        assert result.exit_code == 2, (argv, result.output)
        assert "is not host:port with a port in 1–65535" in result.output, result.output


@pytest.mark.parametrize("flag, value", [("--ready-timeout", "nan"), ("--ready-timeout", "inf"), ("--ready-timeout", "-1"),
                                         ("--ready-timeout", "0"), ("--timeout", "0"), ("--timeout", "nan")])
def test_a_timeout_that_is_not_a_positive_number_is_a_usage_error(flag, value):
    """Found by a bad-input pass: `env check ADDRESS --ready-timeout nan` waited forever for a server
    that was not there (nan compares false with every deadline), and 0 or negative timeouts were
    taken as given. Each is now exit 2 naming the flag, at once, for env check, env replay and
    tasks check."""
    argvs = [["env", "check", "127.0.0.1:1", flag, value]]
    if flag == "--ready-timeout":
        argvs += [["env", "replay", "--env", "mock", "--task", "create_task_1", "--address", "127.0.0.1:1", flag, value],
                  ["tasks", "check", "x", "--env", "mock", "--address", "127.0.0.1:1", flag, value]]
    for argv in argvs:
        t0 = time.monotonic()
        result = CliRunner().invoke(app, argv)
        assert result.exit_code == 2 and time.monotonic() - t0 < 30, (argv, result.output)
        assert f"Invalid value for '{flag}'" in result.output and "is not a number of seconds > 0" in result.output, result.output


def test_a_task_file_that_is_not_utf8_is_named(tmp_path):
    (tmp_path / "tasks.json").write_bytes(b"\xff\xfe[]")
    result = CliRunner().invoke(app, ["tasks", "check", str(tmp_path), "--env", "mock"])
    assert result.exit_code == 2, result.output
    assert f"{tmp_path / 'tasks.json'}: not UTF-8 text" in result.output and "Traceback" not in result.output

    (tmp_path / "tasks.json").write_text('[{"id": ' + "9" * 5000 + "}]")  # Python's 4300-digit limit
    result = CliRunner().invoke(app, ["tasks", "check", str(tmp_path), "--env", "mock"])
    assert result.exit_code == 2 and f"{tmp_path / 'tasks.json'}: a value cannot be read" in result.output, result.output
