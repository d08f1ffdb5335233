# syntax=docker/dockerfile:1
# prefix-proxy image, the product alone (proxy/ and summarizer/, never testbed/): `docker build -t prefix-proxy .`
# (the last stage, `proxy`) then
#   docker run -p 8080:8080 -e PREFIX_PROXY_UPSTREAM=http://vllm:8000/v1 prefix-proxy
# The entrypoint is the `prefix-proxy` CLI with `serve` as default command.
# The bundled fake vLLM (development tooling, testbed/) is a second target, for running the stack without a GPU
# (deploy/docker-compose.yml --profile fake builds it):
#   docker build --target fake-backend -t prefix-proxy-fake-backend .
#   docker run -p 8000:8000 prefix-proxy-fake-backend      (fake-backend --host 0.0.0.0 --port 8000)
# Configuration: environment PREFIX_PROXY_* (nested with __) or a YAML/TOML file via PREFIX_PROXY_CONFIG
# (see docs/deploy.md).

ARG PYTHON_VERSION=3.12

FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY summarizer ./summarizer
# Wheels for the project and every dependency, so the runtime stages need no compiler and no cache.
RUN pip wheel --wheel-dir /wheels .

# The project's wheel again with testbed/ in it, in place of the product's (the dependencies are the same).
FROM build AS build-fake-backend
COPY testbed ./testbed
RUN rm -rf /wheels/prefix_proxy-*.whl build ./*.egg-info \
 && pip wheel --no-deps --wheel-dir /wheels .

# What both images share: Python, an unprivileged user, the CLI as entrypoint.
FROM python:${PYTHON_VERSION}-slim AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
RUN groupadd --system --gid 10001 proxy \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin proxy
WORKDIR /tmp
ENTRYPOINT ["prefix-proxy"]

# `docker build --target fake-backend`: the vLLM stand-in, same API and prefix-cache accounting.
FROM runtime AS fake-backend
RUN --mount=type=bind,from=build-fake-backend,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels prefix-proxy
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
CMD ["fake-backend", "--host", "0.0.0.0", "--port", "8000"]

# The product, and the default target (the last stage): the proxy.
FROM runtime AS proxy
ENV PREFIX_PROXY_HOST=0.0.0.0 \
    PREFIX_PROXY_PORT=8080
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels prefix-proxy
USER 10001:10001
EXPOSE 8080
# /healthz answers while the process is alive; readiness (upstream reachable) is /readyz.
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('PREFIX_PROXY_PORT', '8080'), timeout=2)"]
CMD ["serve"]
