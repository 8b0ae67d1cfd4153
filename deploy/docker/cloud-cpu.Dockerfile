# syntax=docker/dockerfile:1
# The cloud tier on CPU: `apiary cloud serve` (engine + MQTT escalation worker + REST API).
#
#   docker build -f deploy/docker/cloud-cpu.Dockerfile -t apiary-cloud:cpu .      # from the repository root
#   docker run -p 8000:8000 -v apiary-cloud:/var/lib/apiary apiary-cloud:cpu --broker mqtt://broker:1883
#
# The package with its [cloud] extra only (llama.cpp is the edge's). torch comes from its CPU wheel
# index first (the default one pulls a multi-GB CUDA build), pinned like .ci/install. The served model is pulled
# at build time into the image (PRELOAD_MODEL; empty: pulled at the first start into APIARY_MODEL_DIR instead).
ARG PYTHON=3.11

FROM python:${PYTHON}-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/apiary/venv/bin:$PATH \
    APIARY_MODEL_DIR=/opt/apiary/models
RUN python -m venv /opt/apiary/venv
ARG TORCH=2.13.0
RUN pip install torch==${TORCH} --index-url https://download.pytorch.org/whl/cpu
WORKDIR /opt/apiary/src
COPY pyproject.toml README.md ./
COPY apiary/ apiary/
COPY shared/ shared/
COPY cloud/ cloud/
COPY kernels/ kernels/
RUN pip install -e '.[cloud]'
ARG PRELOAD_MODEL=smollm2-135m-q4
RUN mkdir -p "$APIARY_MODEL_DIR" && if [ -n "$PRELOAD_MODEL" ]; then apiary models pull "$PRELOAD_MODEL"; fi

FROM python:${PYTHON}-slim-bookworm
RUN useradd --system --uid 10001 --home-dir /var/lib/apiary --create-home apiary
COPY --from=build /opt/apiary /opt/apiary
RUN chown -R apiary /opt/apiary/models
ENV PATH=/opt/apiary/venv/bin:$PATH APIARY_MODEL_DIR=/opt/apiary/models PYTHONUNBUFFERED=1 \
    APIARY__CLOUD__DB=/var/lib/apiary/cloud.db \
    APIARY__CLOUD__IMAGES=/var/lib/apiary/images \
    APIARY__CLOUD__API_KEY_FILE=/var/lib/apiary/cloud-keys.jsonl
USER apiary
WORKDIR /var/lib/apiary
VOLUME /var/lib/apiary
EXPOSE 8000
# healthy = ready: the model is loaded, the broker connected, not draining (GET /ready)
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/ready', timeout=4)"]
# SIGTERM drains (in-flight requests finish, up to --drain-timeout 30 s): give the container longer to stop
STOPSIGNAL SIGTERM
ENTRYPOINT ["apiary"]
CMD ["cloud", "serve", "--host", "0.0.0.0", "--port", "8000"]
