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
#
# What it installs is what CI tests: Python 3.11 (CI runs 3.11; tests/test_deploy.py compares the two), and
# every dependency at the version constraints.txt pins (CI's scripts/test.sh installs from the same file).
# The base image is pinned by version and digest: a rebuild gets the same Python and Debian packages.

# The interpreter: an exact Python 3.11 release, by digest. To move it, change both (the digest of a tag:
# `docker buildx imagetools inspect python:3.11.X-slim-bookworm`) and keep CI on the same 3.11.
ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm@sha256:d11b9bd5e49ea7401753d78f4d3b56f3aec952b85b49bcae88981f0452818e0b
# The extras of prefix-proxy installed into the proxy image (comma-separated). `otel` (OpenTelemetry, for
# `tracing.enabled: true`, also the Helm chart's `config.tracing`) by default; `--build-arg PROXY_EXTRAS=` makes
# an image without it, which refuses `tracing.enabled: true` at start (exit 2, naming the extra).
ARG PROXY_EXTRAS=otel

FROM ${PYTHON_IMAGE} AS base
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src

# The dependencies pyproject.toml declares (and those of PROXY_EXTRAS), one a line: only this file goes on to
# the dependency stage, so a pyproject.toml change that leaves them alone (the version) rebuilds nothing.
FROM base AS requirements
ARG PROXY_EXTRAS
COPY pyproject.toml ./
RUN python -c "import sys, tomllib; project = tomllib.load(open('pyproject.toml', 'rb'))['project']; extras = [e for e in sys.argv[1].split(',') if e]; print(*project['dependencies'], *(d for e in extras for d in project['optional-dependencies'][e]), sep='\n')" "${PROXY_EXTRAS}" > requirements.txt

# Wheels of every dependency at constraints.txt's versions, before any source is copied: a change to proxy/ or
# summarizer/ does not rebuild them. pip and setuptools (which builds the project's wheel below) pinned too.
FROM base AS deps
COPY constraints.txt ./
COPY --from=requirements /src/requirements.txt ./
RUN pip install -c constraints.txt pip setuptools \
 && pip wheel --wheel-dir /wheels -c constraints.txt -r requirements.txt

# The project's wheel, built from the sources beside the dependencies' (no isolation: the setuptools above).
FROM deps AS build
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY summarizer ./summarizer
RUN pip wheel --no-deps --no-build-isolation --wheel-dir /wheels .

# The project's wheel again with testbed/ in it, in place of the product's (the dependencies are the same).
FROM build AS build-fake-backend
COPY testbed ./testbed
RUN rm -rf /wheels/prefix_proxy-*.whl build ./*.egg-info \
 && pip wheel --no-deps --no-build-isolation --wheel-dir /wheels .

# What both images share: Python, an unprivileged user, the CLI as entrypoint.
FROM ${PYTHON_IMAGE} AS runtime
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

# The product, and the default target (the last stage): the proxy, with PROXY_EXTRAS.
FROM runtime AS proxy
ARG PROXY_EXTRAS
ENV PREFIX_PROXY_HOST=0.0.0.0 \
    PREFIX_PROXY_PORT=8080
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels "prefix-proxy${PROXY_EXTRAS:+[${PROXY_EXTRAS}]}"
USER 10001:10001
EXPOSE 8080
# /healthz answers while the process is alive. Readiness is /readyz: 200 while some upstream serves the API
# with the proxy's key (a session store that does not answer leaves it 200, "degraded", unless
# readiness.require_store), 503 otherwise; docs/deploy.md, "Readiness". Not a container health check.
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('PREFIX_PROXY_PORT', '8080'), timeout=2)"]
CMD ["serve"]
