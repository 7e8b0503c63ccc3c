# syntax=docker/dockerfile:1.7
# reward_service: tau2-Bench's programmatic checker over gRPC. A slim CPU image (no torch,
# no vLLM): NL assertions are judged by an LLM at an OpenAI-compatible endpoint.
#
#   docker build -f docker/reward.Dockerfile -t sinkflex/reward .        # from the repository root
#   docker run -p 50052:50052 -p 9092:9092 sinkflex/reward
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH \
    LITELLM_LOCAL_MODEL_COST_MAP=True HF_HUB_OFFLINE=1 \
    SINKFLEX_CONFIG=configs/retail.yaml \
    SINKFLEX_GRPC_PORT=50052
RUN python3 -m venv /opt/venv

WORKDIR /app
# Dependencies first (cached until pyproject.toml changes): the reward subset of pyproject's pins.
COPY pyproject.toml docker/requirements.py /tmp/build/
RUN python /tmp/build/requirements.py reward cpu --pyproject /tmp/build/pyproject.toml > /tmp/build/requirements.txt \
 && pip install -r /tmp/build/requirements.txt

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
RUN pip install --no-deps . && rm -rf build /tmp/build

# /data: mount point of the run folder's volume (compose's `data`), writable by the service user
# where a one-shot job of this image writes into it first (the generated tasks)
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/sinkflex sinkflex \
 && mkdir -p /data && chown 10001:10001 /data
USER 10001:10001

# OCI image annotations (https://github.com/opencontainers/image-spec/blob/main/annotations.md),
# last: a changed build argument invalidates the cache of every RUN after its ARG, and
# CREATED changes on every build;
# VERSION is pyproject's version, REVISION / CREATED are set by the build
# (--build-arg REVISION=$(git rev-parse HEAD) --build-arg CREATED=$(date -u +%Y-%m-%dT%H:%M:%SZ)).
ARG VERSION=0.1.0
ARG REVISION=""
ARG CREATED=""
LABEL org.opencontainers.image.title="sinkflex-reward" \
      org.opencontainers.image.description="SinkFlex-RL reward service: tau2-Bench's evaluate_simulation over gRPC" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.vendor="SinkFlex-RL"

EXPOSE 50052 9092
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
  CMD python -m sinkflex.healthcheck "127.0.0.1:${SINKFLEX_GRPC_PORT}" || exit 1
# sinkflex-service writes this service's config from the experiment file $SINKFLEX_CONFIG
# (as the embedded default's launcher does) and execs `python -m reward_service --config F ARGS`.
ENTRYPOINT ["sinkflex-service", "reward"]
CMD ["--host", "0.0.0.0", "--port", "50052", "--metrics-port", "9092"]
