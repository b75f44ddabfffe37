# triage-worker with the embedded model (models/triage-mini) and the cascade's escalation stage
# (models/triage-encoder, its encoder copied in by `make setup`), CPU inference. Configure through environment:
# TRIAGE_<SECTION>__<KEY> and KAFKA_<OPTION> (docs/configuration.md).
#   make image                       # = docker/podman build -t triage-worker:local . (deploy/container_engine.py)
#   docker run --rm -e KAFKA_BOOTSTRAP_SERVERS=broker:9092 -p 9400:9400 triage-worker:local
# Without Docker Hub (air-gapped): --build-arg BASE_IMAGE=<an internal Debian/Python 3.11+ image> (or one that
# deploy/offline-base.sh builds from Debian packages), --build-arg PIP_INDEX_URL=<your PyPI mirror>, and
# --secret id=pip-ca,src=<CA bundle> when that mirror or a proxy uses a private CA. docs/containers.md.
# No `# syntax=` line: BuildKit would pull its frontend image from Docker Hub, which an air-gapped build cannot.
# deploy/build_check.py replays this file's build steps in a plain venv (no engine needed; `make test` runs it);
# `make image-check` runs the built image against a real broker.

ARG PYTHON_VERSION=3.12
# Any Debian-like image with Python 3.11+ (`python`, venv) and groupadd/useradd.
ARG BASE_IMAGE=python:${PYTHON_VERSION}-slim-bookworm

# -- build: the package and its dependencies into a self-contained venv ---------------------------------------
FROM ${BASE_IMAGE} AS build
ARG PIP_INDEX_URL=https://pypi.org/simple
ENV VIRTUAL_ENV=/opt/venv \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
# The whole build context: .dockerignore keeps it to what the wheel is built from.
COPY . .
# `pip install` builds the wheel and installs it: whatever the wheel carries (package data) is in the venv.
# [cpu]: the CPU build of ONNX Runtime GenAI, where that is an extra; [otel]: per-ticket traces, off unless the
# OTEL_* variables or a [tracing] section turn them on (docs/operations.md#tracing). Bytecode is compiled here (pip's default):
# the root filesystem is read-only at run time on Kubernetes. The CA bundle is a build secret: it trusts the
# index for this step only and never lands in a layer.
RUN --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
    && python -m venv "$VIRTUAL_ENV" && "$VIRTUAL_ENV/bin/pip" install ".[cpu,otel]"

# -- runtime: the venv, the model, an unprivileged user ------------------------------------------------------
FROM ${BASE_IMAGE} AS runtime
RUN groupadd --system --gid 10001 triage \
    && useradd --system --uid 10001 --gid triage --no-create-home --shell /usr/sbin/nologin triage
COPY --from=build /opt/venv /opt/venv
COPY models/triage-mini/ /app/models/triage-mini/
COPY taxonomies/ /app/taxonomies/
WORKDIR /app
# The installed package has no repository around it: point it at the model explicitly. Metrics and probes are
# on (port 9400) in the image, JSON logs for log shippers. ORT_DISABLE_TELEMETRY: onnxruntime and
# onnxruntime-genai send no telemetry to their vendor from any process in the image (the package sets it too):
# the worker opens no connection but its broker's, its Schema Registry's and its metrics port (docs/privacy.md).
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    ORT_DISABLE_TELEMETRY=1 \
    TRIAGE_INFERENCE__MODEL=/app/models/triage-mini \
    TRIAGE_METRICS__PORT=9400 \
    TRIAGE_LOG__FORMAT=json
USER 10001:10001
EXPOSE 9400
# Docker and compose use this; Kubernetes uses the Deployment's probes (same endpoint) instead.
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ['TRIAGE_METRICS__PORT'], timeout=2)"]
ENTRYPOINT ["triage-worker"]
CMD ["run"]
