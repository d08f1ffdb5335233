"""One set of deployment docs: docs/deploy.md covers the Helm chart, Redis Cluster and readiness as they are,
and no doc, comment or note describes ``/readyz`` as an upstream check only (it checks the session store
too: proxy/readiness.py)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEPLOY_DOC = ROOT / "docs/deploy.md"
# What said "/readyz checks the upstream" before the store joined it (issue 47).
STALE = (
    r"/readyz`? checks (vLLM|the upstream)",
    r"/readyz`? \(an upstream reachable",
    r"readiness \(upstream reachable\)",
    r"no Redis Cluster",
    r"Redis Cluster (is not supported|does not work)",
)


def texts() -> dict[str, str]:
    paths = [
        ROOT / "README.md",
        ROOT / "Dockerfile",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "deploy").rglob("*.md")),
        *sorted((ROOT / "deploy").rglob("*.yaml")),
        *sorted((ROOT / "deploy").rglob("*.yml")),
        *sorted((ROOT / "deploy").rglob("*.txt")),
    ]
    return {str(path.relative_to(ROOT)): path.read_text() for path in paths}


def test_no_doc_calls_readyz_an_upstream_check_or_redis_cluster_unsupported() -> None:
    found = [
        f"{name}: {match.group(0)!r}"
        for name, text in texts().items()
        for pattern in STALE
        for match in re.finditer(pattern, " ".join(text.split()), re.IGNORECASE)
    ]
    assert not found, found


def test_deploy_doc_covers_helm_redis_cluster_readiness_and_the_image() -> None:
    text = " ".join(DEPLOY_DOC.read_text().split())
    for needed in (
        "## Kubernetes with Helm",
        "helm install prefix-proxy deploy/helm/prefix-proxy",
        "readiness.requireStore",
        "readiness.require_store",
        "redis-cluster",
        "sessions.redis_cluster: true",
        '"status": "degraded"',
        "the session store is down",
        "constraints.txt",
        "PROXY_EXTRAS",
        "Python 3.11",
        "BIND_ADDRESS",
    ):
        assert needed in text, needed
