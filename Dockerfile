# syntax=docker/dockerfile:1
# pagemesh images. One image runs any service of the mesh; compose picks which by its command:
#
#   docker build --target cpu  -t pagemesh:cpu  .     # torch's CPU build (gloo between ranks)
#   docker build --target cuda -t pagemesh:cuda .     # torch's CUDA build, Triton, NCCL
#
#   python -m router.main | python -m scheduler_svc.main | python -m worker_svc.main
#
# configured by PAGEMESH_* variables (every flag has one: --redis-url is PAGEMESH_REDIS_URL;
# PAGEMESH_X_FILE names a file holding X's value, for secrets). Without a command the image
# runs `pagemesh up`: the whole mesh with the default model. Its `--host 0.0.0.0` opens the
# router alone to the network: the scheduler, workers and embedded Valkey bind 127.0.0.1.
#
# It installs exactly as `make install` does, through scripts/install.sh, one layer per step,
# the slowest to change first: torch, the default model, pyproject's dependencies, then the
# source (tests/deploy/test_dockerfile.py holds both files to that).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- what both images share: Python, a venv on PATH, a non-root user
FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VENV=/opt/pagemesh/.venv \
    PATH=/opt/pagemesh/.venv/bin:$PATH
# targets/: where compose mounts the volume of Prometheus' target list (`pagemesh top
# --prometheus-targets`); a new volume takes the owner of the folder it is mounted on.
RUN groupadd --gid 1000 pagemesh \
 && useradd --uid 1000 --gid pagemesh --create-home --shell /usr/sbin/nologin pagemesh \
 && install -d -o pagemesh -g pagemesh /home/pagemesh/targets
WORKDIR /opt/pagemesh
COPY scripts/install.sh scripts/install.sh
# router gRPC and HTTP (OpenAI API), scheduler, worker, Prometheus /metrics (router 9100, ...)
EXPOSE 50051 8000 50060 50070 9100 9101 9102 9103
# Every service answers gRPC health on PAGEMESH_PORT (the router's 50051 when unset); compose
# sets PAGEMESH_PORT for schedulers and workers, whose own default is any free port.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD pagemesh health --address "127.0.0.1:${PAGEMESH_PORT:-50051}" --timeout-s 3 || exit 1

# ---- torch, CPU build. gcc builds the C decode-attention kernel at start-up
# (kernels/cpu_native.py, ~0.3 s, cached in the user's home); without it workers use the
# slower torch path.
FROM base AS torch-cpu
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev libgomp1 \
 && rm -rf /var/lib/apt/lists/*
ARG TORCH_VERSION=2.13.0
# scripts/install.sh torch reads both ARGs (RUN sees them as variables).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN sh scripts/install.sh torch

# ---- torch, CUDA build: PyPI's Linux wheel bundles the CUDA libraries (cuBLAS, cuDNN, NCCL);
# the NVIDIA container toolkit mounts the driver. Triton builds its launchers with a C compiler
# at run time, hence gcc. Another CUDA build: --build-arg TORCH_INDEX_URL=<PyTorch's cuXYZ index>.
FROM base AS torch-cuda
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
RUN sh scripts/install.sh torch

# ---- the CPU image
FROM torch-cpu AS cpu
ARG INSTALL_EXTRAS=
RUN sh scripts/install.sh model
COPY pyproject.toml ./
RUN sh scripts/install.sh deps "${INSTALL_EXTRAS}"
COPY . .
RUN sh scripts/install.sh package
USER pagemesh
CMD ["pagemesh", "up", "--host", "0.0.0.0"]

# ---- the CUDA image (the same steps as cpu)
FROM torch-cuda AS cuda
ARG INSTALL_EXTRAS=
RUN sh scripts/install.sh model
COPY pyproject.toml ./
RUN sh scripts/install.sh deps "${INSTALL_EXTRAS}"
COPY . .
RUN sh scripts/install.sh package
USER pagemesh
CMD ["pagemesh", "up", "--host", "0.0.0.0", "--device", "cuda"]
