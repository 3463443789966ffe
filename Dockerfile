# syntax=docker/dockerfile:1
# Rankgate gateway image. Runs beside a vLLM container in the same pod / network namespace:
#   docker run --network container:vllm -e RANKGATE_ENGINE=127.0.0.1:50051 rankgate

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/rankgate
COPY pyproject.toml README.md ./
COPY app ./app
COPY sidecar ./sidecar
COPY multimodal ./multimodal
COPY mocker ./mocker
RUN /opt/rankgate/bin/pip install --no-compile .

FROM python:3.11-slim AS runtime
ENV PATH=/opt/rankgate/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    RANKGATE_HOST=0.0.0.0 \
    RANKGATE_PORT=8000
COPY --from=build /opt/rankgate /opt/rankgate
RUN useradd --system --uid 10001 --no-create-home rankgate
USER 10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(f\"http://127.0.0.1:{os.environ.get('RANKGATE_PORT', '8000')}/ready\", timeout=2)"]
ENTRYPOINT ["rankgate", "serve"]
