# syntax=docker/dockerfile:1
# The device side: `apiary edge run` (llama.cpp INT4 model, escalation, OTA) and `apiary bridge udp|serial`,
# for arm64 (Raspberry Pi 4/5, Jetson CPU side) and amd64 gateways, without torch or the cloud:
#
#   docker buildx build --platform linux/arm64,linux/amd64 -f deploy/docker/edge.Dockerfile -t apiary-edge .
#   docker run -v apiary-edge:/var/lib/apiary apiary-edge edge run --device hive-0001 --broker mqtt://broker:1883
#   docker run -p 47474:47474/udp apiary-edge bridge udp --broker mqtt://broker:1883
#   docker run --device /dev/ttyUSB0 apiary-edge bridge serial /dev/ttyUSB0 --broker mqtt://broker:1883
#
# The package with its [edge] extra only: no torch, no web stack. llama.cpp (llama-cpp-python) is built for the target's baseline: AVX2/FMA/F16C on amd64
# (any x86 since 2013), plain ARMv8-A on arm64 (the Pi 4's Cortex-A72); override LLAMA_CMAKE_ARGS for more.
# On a device, prefer the systemd units in deploy/systemd/ (no container runtime needed).
ARG PYTHON=3.11

FROM python:${PYTHON}-slim-bookworm AS build
ARG TARGETARCH
ARG LLAMA_CMAKE_ARGS=""
RUN apt-get update && apt-get install -y --no-install-recommends build-essential cmake \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/apiary/venv/bin:$PATH
RUN python -m venv /opt/apiary/venv
WORKDIR /opt/apiary/src
COPY pyproject.toml README.md ./
COPY apiary/ apiary/
COPY shared/ shared/
COPY edge/ edge/
COPY firmware_bridge/ firmware_bridge/
RUN if [ -n "$LLAMA_CMAKE_ARGS" ]; then args="$LLAMA_CMAKE_ARGS"; \
    elif [ "$TARGETARCH" = "arm64" ]; then args="-DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH=armv8-a"; \
    else args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
               -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"; fi \
    && CMAKE_ARGS="$args" pip install -e '.[edge]'

FROM python:${PYTHON}-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home-dir /var/lib/apiary --create-home --groups dialout apiary
COPY --from=build /opt/apiary /opt/apiary
ENV PATH=/opt/apiary/venv/bin:$PATH PYTHONUNBUFFERED=1 \
    APIARY_MODEL_DIR=/var/lib/apiary/models \
    APIARY__EDGE__STATE_DIR=/var/lib/apiary/edge
USER apiary
WORKDIR /var/lib/apiary
# the outbox, inbox, OTA slots and unpacked models: keep them on persistent storage
VOLUME /var/lib/apiary
ENTRYPOINT ["apiary"]
CMD ["edge", "run", "--help"]
