# syntax=docker/dockerfile:1
# Rankgate gateway image. It runs beside a vLLM container in the same pod or network namespace
# and reaches vLLM's gRPC port on loopback; every `rankgate serve` flag is a RANKGATE_* variable.
# The gateway's port is published on the vLLM container, whose network namespace it joins:
#
#   docker build -t rankgate .
#   docker run -d --name vllm --gpus all -p 8080:8080 -v hf:/data/hf -e HF_HOME=/data/hf \
#     -e VLLM_USE_RUST_FRONTEND=1 vllm/vllm-openai:v0.32.0 MODEL --grpc-port 50051 \
#     --data-parallel-size 2 \
#     --kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5600","topic":"kv-events"}'
#   docker run -d --name rankgate --network container:vllm -v hf:/data/hf:ro \
#     -e HF_HOME=/data/hf -e RANKGATE_ENGINE=127.0.0.1:50051 -e RANKGATE_PORT=8080 rankgate
#
# Without RANKGATE_ENGINE (or the prefill/decode pair) the container exits at once with a
# message naming it, instead of serving the bundled demo engine on 0.0.0.0.
#
# tests/deploy/test_image.py runs this file's build-stage RUN commands in a temporary
# directory and starts the gateway from the result; keep the commands plain shell.

# The official image's CPython is built with profile-guided and link-time optimization; the
# gateway's CPU figures in docs/benchmarks.md are for such a build (a plain one costs about 6%
# more CPU a request). A replacement base image should be built the same way.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# The same Python with a C compiler: the build stage compiles the route decision's modules with
# mypyc (setup.py), a third less CPU a decision. The runtime stage takes only the result.
ARG BUILD_IMAGE=python:3.11-bookworm

FROM ${BUILD_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
RUN python -m venv /opt/rankgate
COPY pyproject.toml README.md ./
COPY setup.py ./
COPY rankgate ./rankgate
# Bytecode is compiled here: the runtime user cannot write it next to the sources. mypy builds
# the compiled router and leaves with pip; the check fails the build if the router is pure.
RUN /opt/rankgate/bin/python -m pip install . "mypy==2.4.0" "setuptools==84.0.0" \
 && RANKGATE_COMPILE=1 /opt/rankgate/bin/python -m pip install --no-build-isolation --no-deps \
      --force-reinstall . \
 && /opt/rankgate/bin/python -m pip uninstall --yes mypy setuptools pip \
 && /opt/rankgate/bin/python -I -c "import rankgate.sidecar.routing.policies.kv as kv; assert kv.__file__.endswith('.so'), kv.__file__" \
 && /opt/rankgate/bin/rankgate --version

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="rankgate" \
      org.opencontainers.image.description="OpenAI-compatible gateway with KV-cache-aware data-parallel routing for vLLM" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 rankgate \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --no-log-init \
      --home-dir /nonexistent --shell /usr/sbin/nologin rankgate
COPY --from=build /opt/rankgate /opt/rankgate
ENV PATH=/opt/rankgate/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    RANKGATE_HOST=0.0.0.0 \
    RANKGATE_PORT=8000 \
    RANKGATE_REQUIRE_ENGINE=true
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('RANKGATE_PORT', '8000') + '/ready', timeout=2)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["rankgate", "serve"]
