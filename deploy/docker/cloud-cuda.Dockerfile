# syntax=docker/dockerfile:1
# The cloud tier on an NVIDIA GPU: `apiary cloud serve` with the engine on CUDA (Triton kernels, bfloat16).
#
#   docker build -f deploy/docker/cloud-cuda.Dockerfile -t apiary-cloud:cuda .     # from the repository root
#   docker run --gpus all -p 8000:8000 -v apiary-cloud:/var/lib/apiary apiary-cloud:cuda --broker mqtt://broker:1883
#
# The package with its [cloud] and [gpu] (Triton) extras. torch's Linux wheels from PyPI carry their CUDA libraries, so the base image needs only the driver's
# libraries (mounted by the NVIDIA Container Toolkit). Triton compiles a small launcher with the C compiler
# and Python's headers at run time, so both stay in the final image.
ARG CUDA_BASE=nvidia/cuda:12.8.1-base-ubuntu24.04

FROM ${CUDA_BASE} AS build
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/apiary/venv/bin:$PATH \
    APIARY_MODEL_DIR=/opt/apiary/models
RUN python3 -m venv /opt/apiary/venv
ARG TORCH=2.13.0
RUN pip install torch==${TORCH}
WORKDIR /opt/apiary/src
COPY pyproject.toml README.md ./
COPY apiary/ apiary/
COPY shared/ shared/
COPY cloud/ cloud/
COPY kernels/ kernels/
RUN pip install -e '.[cloud,gpu]'
ARG PRELOAD_MODEL=smollm2-135m-q4
RUN mkdir -p "$APIARY_MODEL_DIR" && if [ -n "$PRELOAD_MODEL" ]; then apiary models pull "$PRELOAD_MODEL"; fi

FROM ${CUDA_BASE}
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-dev gcc libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home-dir /var/lib/apiary --create-home apiary
COPY --from=build /opt/apiary /opt/apiary
RUN chown -R apiary /opt/apiary/models
ENV PATH=/opt/apiary/venv/bin:$PATH APIARY_MODEL_DIR=/opt/apiary/models PYTHONUNBUFFERED=1 \
    APIARY__CLOUD__DEVICE=cuda \
    APIARY__CLOUD__DB=/var/lib/apiary/cloud.db \
    APIARY__CLOUD__IMAGES=/var/lib/apiary/images \
    APIARY__CLOUD__API_KEY_FILE=/var/lib/apiary/cloud-keys.jsonl \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER apiary
WORKDIR /var/lib/apiary
VOLUME /var/lib/apiary
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/ready', timeout=4)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["apiary"]
CMD ["cloud", "serve", "--host", "0.0.0.0", "--port", "8000"]
