# syntax=docker/dockerfile:1
# prefix-proxy image: `docker build -t prefix-proxy .` then
#   docker run -p 8080:8080 -e PREFIX_PROXY_UPSTREAM=http://vllm:8000/v1 prefix-proxy
# The entrypoint is the `prefix-proxy` CLI with `serve` as default command, so the same image runs the
# bundled fake backend too: docker run prefix-proxy fake-backend --host 0.0.0.0 --port 8000
# Configuration: environment PREFIX_PROXY_* (nested with __) or a YAML/TOML file via PREFIX_PROXY_CONFIG
# (see docs/deploy.md).

ARG PYTHON_VERSION=3.12

FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY summarizer ./summarizer
COPY testbed ./testbed
# Wheels for the project and every dependency, so the runtime stage needs no compiler and no cache.
RUN pip wheel --wheel-dir /wheels .

FROM python:${PYTHON_VERSION}-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PREFIX_PROXY_HOST=0.0.0.0 \
    PREFIX_PROXY_PORT=8080
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels prefix-proxy \
 && groupadd --system --gid 10001 proxy \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin proxy
USER 10001:10001
WORKDIR /tmp
EXPOSE 8080
# /healthz answers while the process is alive; readiness (upstream reachable) is /readyz.
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('PREFIX_PROXY_PORT', '8080'), timeout=2)"]
ENTRYPOINT ["prefix-proxy"]
CMD ["serve"]
