"""deploy/, the Dockerfile and the Grafana files: valid against their schemas and consistent with each other.

Offline: Kubernetes manifests against the schemas bundled in kubernetes-validate (ServiceMonitor, a CRD,
against tests/data/servicemonitor-v1.schema.json), the compose file against the compose specification's
JSON schema as bundled by check-jsonschema, the Dockerfile through the `dockerfile` package (Docker's own
parser). No Docker engine and no cluster needed.
"""

from __future__ import annotations

import copy
import importlib
import importlib.resources
import json
import os
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import pytest
import yaml
from pydantic import BaseModel

from proxy.capacity.kvcache import PRESETS
from proxy.config import Settings

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "docker-compose.yml"
DASHBOARD = DEPLOY / "grafana/dashboards/prefix-proxy.json"
SERVICEMONITOR_SCHEMA = ROOT / "tests/data/servicemonitor-v1.schema.json"
KUBERNETES_VERSIONS = ("1.27.0", "1.30.0", "latest")


def need(module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError:
        pytest.fail(f"the test dependency {module!r} is missing: pip install -e '.[test]'")


# -- Kubernetes -------------------------------------------------------------------------------------


def manifests() -> dict[str, dict[str, Any]]:
    """Every object in deploy/k8s, by kind (each kind appears once)."""
    objects: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                assert doc["kind"] not in objects, f"two {doc['kind']} objects"
                objects[doc["kind"]] = doc
    return objects


def validate_k8s(doc: dict[str, Any], version: str) -> None:
    kubernetes_validate = need("kubernetes_validate")
    if version == "latest":
        version = kubernetes_validate.utils.latest_version()
    kubernetes_validate.validate(doc, version, strict=True)


def servicemonitor_validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SERVICEMONITOR_SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_manifests_cover_the_deployment() -> None:
    assert set(manifests()) >= {
        "Namespace",
        "ConfigMap",
        "Secret",
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "ServiceMonitor",
    }


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("kind", sorted(set(manifests()) - {"ServiceMonitor"}))
def test_manifest_validates_against_the_kubernetes_schema(kind: str, version: str) -> None:
    validate_k8s(manifests()[kind], version)


def test_servicemonitor_validates_against_the_crd_schema() -> None:
    errors = [error.message for error in servicemonitor_validator().iter_errors(manifests()["ServiceMonitor"])]
    assert not errors, errors


def test_validators_reject_unknown_fields() -> None:
    """The checks above are strict: a misspelt field fails them."""
    kubernetes_validate = need("kubernetes_validate")
    deployment = copy.deepcopy(manifests()["Deployment"])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_k8s(deployment, "latest")
    monitor = copy.deepcopy(manifests()["ServiceMonitor"])
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    assert list(servicemonitor_validator().iter_errors(monitor))


def test_manifests_fit_together() -> None:
    m = manifests()
    namespace = m["Namespace"]["metadata"]["name"]
    assert all(doc["metadata"].get("namespace") == namespace for kind, doc in m.items() if kind != "Namespace")
    deployment, service, hpa = m["Deployment"], m["Service"], m["HorizontalPodAutoscaler"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selectors = [
        deployment["spec"]["selector"]["matchLabels"],
        service["spec"]["selector"],
        m["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
    ]
    for selector in selectors:
        assert selector.items() <= pod_labels.items()
    assert m["ServiceMonitor"]["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "prefix-proxy"}
    # The job label of a ServiceMonitor is the Service's name: the alert rules expect prefix-proxy.
    assert service["metadata"]["name"] == "prefix-proxy"

    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container_ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    service_ports = {port["name"]: port for port in service["spec"]["ports"]}
    assert all(port["targetPort"] in container_ports for port in service_ports.values())
    endpoint = m["ServiceMonitor"]["spec"]["endpoints"][0]
    assert endpoint["path"] == "/metrics"
    # /metrics is scraped on its own port, which the proxy is told to serve it on, with the key it
    # is told to require (the same Secret key).
    env = {e["name"]: e for e in container["env"]}
    assert endpoint["port"] == "metrics" and endpoint["port"] in service_ports
    assert str(container_ports["metrics"]) == env["PREFIX_PROXY_METRICS_PORT"]["value"]
    assert container_ports["metrics"] != container_ports["http"]
    secret_ref = env["PREFIX_PROXY_METRICS_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert endpoint["authorization"]["credentials"] == {"name": secret_ref["name"], "key": secret_ref["key"]}
    assert secret_ref["key"] in m["Secret"]["stringData"] and not secret_ref.get("optional")


def test_deployment_probes_security_and_resources() -> None:
    spec = manifests()["Deployment"]["spec"]["template"]["spec"]
    container = spec["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert "memory" in container["resources"]["limits"]
    assert manifests()["HorizontalPodAutoscaler"]["apiVersion"] == "autoscaling/v2"


def test_deployment_reads_the_configmap_and_secret_it_mounts() -> None:
    m = manifests()
    spec = m["Deployment"]["spec"]["template"]["spec"]
    container = spec["containers"][0]
    env = {item["name"]: item for item in container["env"]}
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    config_path = Path(env["PREFIX_PROXY_CONFIG"]["value"])
    (config_volume,) = [name for name, v in volumes.items() if v.get("configMap")]
    assert volumes[config_volume]["configMap"]["name"] == m["ConfigMap"]["metadata"]["name"]
    assert config_path.parent == Path(mounts[config_volume])
    assert config_path.name in m["ConfigMap"]["data"]

    secret = m["Secret"]
    for item in env.values():
        ref = item.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            assert ref["name"] == secret["metadata"]["name"]
            assert ref.get("optional") or ref["key"] in secret["stringData"], f"required key {ref['key']} missing"
            assert ref["name"] == secret["metadata"]["name"]
    # An empty admin key would not disable the admin API: the template must not ship one.
    assert "admin-api-key" not in secret["stringData"]
    json.loads(secret["stringData"]["tenants.json"])  # a JSON list, as PREFIX_PROXY_TENANTS expects


# -- proxy configuration files ----------------------------------------------------------------------


def unknown_keys(model: type[BaseModel], data: Any, path: str = "") -> list[str]:
    """Keys of ``data`` that ``model`` does not define (Settings ignores unknown keys: typos go unnoticed)."""
    if not isinstance(data, dict):
        return []
    problems = []
    for key, value in data.items():
        field = model.model_fields.get(key)
        if field is None:
            problems.append(f"{path}{key}")
            continue
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            problems += unknown_keys(annotation, value, f"{path}{key}.")
    return problems


def proxy_config_files() -> dict[str, dict[str, Any]]:
    return {
        "deploy/proxy.yaml": yaml.safe_load((DEPLOY / "proxy.yaml").read_text()),
        "deploy/k8s/configmap.yaml": yaml.safe_load(manifests()["ConfigMap"]["data"]["config.yaml"]),
    }


@pytest.mark.parametrize("name", sorted(proxy_config_files()))
def test_proxy_config_files_load_with_known_keys_only(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = proxy_config_files()[name]
    assert not unknown_keys(Settings, data), f"{name}: unknown settings {unknown_keys(Settings, data)}"
    for key in [k for k in os.environ if k.startswith("PREFIX_PROXY_")]:
        monkeypatch.delenv(key)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    monkeypatch.setenv("PREFIX_PROXY_CONFIG", str(path))
    if name == "deploy/proxy.yaml":
        # The compose stack's file, read as its proxy service reads it: with that service's
        # environment, each ${VAR:-default} at its default (the environment wins over the file).
        compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
        for key, value in compose["services"]["proxy"]["environment"].items():
            if key != "PREFIX_PROXY_CONFIG":
                monkeypatch.setenv(key, re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(value)))
    settings = Settings()
    assert settings.sessions.store == "redis"
    if settings.kv_model:
        assert settings.kv_model in PRESETS


# -- docker compose ---------------------------------------------------------------------------------


def compose_schema() -> dict[str, Any]:
    need("check_jsonschema")
    vendor = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    schema: dict[str, Any] = json.loads((vendor / "compose-spec.json").read_text())
    return schema


def interpolate(node: Any, env: dict[str, str]) -> Any:
    """Compose's variable interpolation: ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, $VAR, $$."""
    if isinstance(node, dict):
        return {key: interpolate(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolate(item, env) for item in node]
    if not isinstance(node, str):
        return node

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(4)
        op, arg = match.group(2), match.group(3) or ""
        value = env.get(name)
        if op == ":-":
            return value if value else arg
        if op == "-":
            return value if value is not None else arg
        if op in (":?", "?"):
            assert value, f"${{{name}}} is required: {arg}"
        return value or ""

    return re.sub(r"\$\$|\$\{(\w+)(?:(:-|-|:\?|\?)([^}]*))?\}|\$(\w+)", replace, node)


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def test_compose_file_validates_against_the_compose_spec() -> None:
    validator = jsonschema.Draft202012Validator(compose_schema())
    for label, document in (("as written", compose()), ("interpolated", interpolate(compose(), {}))):
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]
        assert not errors, f"{label}: {errors}"


def test_compose_schema_rejects_unknown_fields() -> None:
    broken = compose()
    broken["services"]["proxy"]["helthcheck"] = {}
    assert list(jsonschema.Draft202012Validator(compose_schema()).iter_errors(broken))


def test_compose_profiles_switch_between_vllm_and_the_fake_backend() -> None:
    services = interpolate(compose(), {})["services"]
    assert services["vllm"]["profiles"] == ["gpu"]
    assert services["fake-vllm"]["profiles"] == ["fake"]
    always = {name for name, service in services.items() if "profiles" not in service}
    assert always == {"proxy", "redis", "prometheus", "grafana"}
    # Both backends answer as `vllm`, so the default upstream and Prometheus' vllm job reach either.
    assert "vllm" in services["fake-vllm"]["networks"]["default"]["aliases"]
    assert services["proxy"]["environment"]["PREFIX_PROXY_UPSTREAM"] == "http://vllm:8000/v1"
    overridden = interpolate(compose(), {"UPSTREAM_URL": "http://gpu-box:8000/v1"})["services"]
    assert overridden["proxy"]["environment"]["PREFIX_PROXY_UPSTREAM"] == "http://gpu-box:8000/v1"
    # The proxy must start whichever backend profile runs: it may depend on neither.
    assert set(services["proxy"].get("depends_on", {})) == {"redis"}


def test_compose_builds_the_proxy_and_the_fake_backend_from_their_targets() -> None:
    services = interpolate(compose(), {})["services"]
    targets = {name: services[name]["build"]["target"] for name in ("proxy", "fake-vllm")}
    assert targets == {"proxy": "proxy", "fake-vllm": "fake-backend"}
    assert set(targets.values()) <= set(named_stages())
    # Two images: the fake backend's must not be tagged as the proxy's.
    assert services["proxy"]["image"] != services["fake-vllm"]["image"]
    assert services["fake-vllm"]["command"][0] == "fake-backend"


def test_compose_vllm_serves_with_prefix_caching_and_cached_token_details() -> None:
    raw = compose()["services"]["vllm"]
    assert raw["image"].startswith("vllm/vllm-openai:")
    command = " ".join(raw["command"])
    assert "--enable-prefix-caching" in command
    assert "--enable-prompt-tokens-details" in command
    assert "${VLLM_MODEL" in command
    assert "${VLLM_GPU_COUNT" in command
    (device,) = raw["deploy"]["resources"]["reservations"]["devices"]
    assert device["count"].startswith("${VLLM_GPU_COUNT") and device["capabilities"] == ["gpu"]


def test_compose_services_are_wired_to_each_other() -> None:
    services = interpolate(compose(), {})["services"]
    proxy = services["proxy"]
    env = proxy["environment"]
    assert env["PREFIX_PROXY_SESSIONS__STORE"] == "redis"
    assert env["PREFIX_PROXY_SESSIONS__REDIS_URL"].startswith("redis://redis:6379")
    assert env["PREFIX_PROXY_KV_MODEL"] in PRESETS
    assert "/healthz" in " ".join(proxy["healthcheck"]["test"])
    assert proxy["build"]["context"] == ".." and (DEPLOY / proxy["build"]["context"] / "Dockerfile").is_file()
    redis_command = " ".join(services["redis"]["command"])
    assert "--appendonly yes" in redis_command
    assert any(volume.endswith(":/data") for volume in services["redis"]["volumes"])
    # Every file or folder a service mounts from the repository exists (proxy.env is optional).
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name} mounts {source}, which does not exist"
    config_mount = next(v for v in proxy["volumes"] if v.endswith(":ro")).split(":")[1]
    assert env["PREFIX_PROXY_CONFIG"] == config_mount


def test_prometheus_config_scrapes_the_compose_services() -> None:
    prometheus = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    proxy_sd = jobs["prefix-proxy"]["dns_sd_configs"][0]
    assert jobs["vllm"]["static_configs"][0]["targets"] == ["vllm:8000"]
    services = interpolate(compose(), {})["services"]
    assert "proxy" in services and services["proxy"]["environment"]["PREFIX_PROXY_PORT"] == "8080"
    # /metrics on its own port, scraped there and not published to the host.
    metrics_port = services["proxy"]["environment"]["PREFIX_PROXY_METRICS_PORT"]
    assert proxy_sd["names"] == ["proxy"] and str(proxy_sd["port"]) == metrics_port != "8080"
    assert not any(metrics_port in str(port) for port in services["proxy"].get("ports", []))
    mounts = services["prometheus"]["volumes"]
    assert "./prometheus:/etc/prometheus:ro" in mounts
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]


# -- Grafana ----------------------------------------------------------------------------------------


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def test_dashboard_json_is_generated_from_its_source() -> None:
    source = importlib.import_module("deploy.grafana.dashboard")  # the repo root is on pytest's pythonpath
    assert DASHBOARD.read_text() == source.render(), (
        "deploy/grafana/dashboards/prefix-proxy.json is stale: "
        "python deploy/grafana/dashboard.py > deploy/grafana/dashboards/prefix-proxy.json"
    )


def test_dashboard_is_importable_and_provisionable() -> None:
    board = dashboard()
    variables = {variable["name"]: variable for variable in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["description"], panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"] and target["expr"].strip(), panel["title"]
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_dashboard_has_the_required_panels() -> None:
    exprs = "\n".join(t["expr"] for p in dashboard()["panels"] for t in p.get("targets", []))
    for needle in (
        "prefix_proxy_cached_tokens_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "prefix_proxy_prefill_tokens_total",
        "sum by (source) (rate(prefix_proxy_tokens_saved_total",
        "histogram_quantile(0.99, sum by (le) (rate(prefix_proxy_overhead_seconds_bucket",
        "histogram_quantile(0.5, sum by (le) (rate(prefix_proxy_overhead_seconds_bucket",
        "prefix_proxy_time_to_first_token_seconds_bucket",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:kv_cache_usage_perc",
        "prefix_proxy_sessions_active",
        "sum by (outcome) (rate(prefix_proxy_compactions_total",
        "prefix_proxy_budget_rejections_total",
        "prefix_proxy_store_up",
        "prefix_proxy_store_errors_total",
        "sum by (kind) (rate(prefix_proxy_canon_actions_total",
        'status=~"5.."',
        "sum by (cause) (rate(prefix_proxy_cache_break_tokens_total",
    ):
        assert needle in exprs, needle


def test_grafana_provisioning_matches_the_compose_mounts() -> None:
    grafana = interpolate(compose(), {})["services"]["grafana"]
    mounts = dict(volume.split(":")[:2] for volume in grafana["volumes"] if volume.startswith("."))
    assert (DEPLOY / "grafana/provisioning").resolve() == (
        DEPLOY / next(source for source, target in mounts.items() if target == "/etc/grafana/provisioning")
    ).resolve()
    dashboards_target = mounts["./grafana/dashboards"]
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/prefix-proxy.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == dashboards_target
    assert provider["providers"][0]["type"] == "file"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{dashboards_target}/{DASHBOARD.name}"
    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = datasource["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090" and source["isDefault"]


# -- Dockerfile -------------------------------------------------------------------------------------


def dockerfile_commands() -> list[Any]:
    return list(need("dockerfile").parse_file(str(ROOT / "Dockerfile")))


def dockerfile_args() -> dict[str, str]:
    """The Dockerfile's global ``ARG``s (those before the first ``FROM``) with their defaults."""
    args: dict[str, str] = {}
    for command in dockerfile_commands():
        if command.cmd.upper() == "FROM":
            break
        if command.cmd.upper() == "ARG":
            name, _, default = command.value[0].partition("=")
            args[name] = default
    return args


def base_image(name: str) -> str:
    """The image stage ``name`` builds on, its ``${ARG}`` replaced by the ARG's default."""
    image: str = stage_settings(name)["FROM"]
    return re.sub(r"\$\{(\w+)\}", lambda m: dockerfile_args()[m.group(1)], image)


def dockerfile_stages() -> list[list[Any]]:
    stages: list[list[Any]] = []
    for command in dockerfile_commands():
        if command.cmd.upper() == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(command)
    return stages


def named_stages() -> dict[str, list[Any]]:
    """The Dockerfile's stages by their ``FROM ... AS name``."""
    named = {}
    for stage in dockerfile_stages():
        image, *alias = stage[0].value
        assert len(alias) == 2 and alias[0].upper() == "AS", f"FROM {image}: every stage is named"
        named[alias[1]] = stage
    return named


def stage_chain(name: str) -> list[list[Any]]:
    """A stage and the stages it is ``FROM``, the first one first (its ``FROM`` names a base image)."""
    stages = named_stages()
    chain = []
    while name in stages:
        chain.insert(0, stages[name])
        name = stages[name][0].value[0]
    return chain


def stage_settings(name: str) -> dict[str, Any]:
    """The instructions a stage runs with (the last of each kind), those of the stages it is FROM included;
    ``FROM`` is the base image the chain starts from."""
    chain = stage_chain(name)
    settings: dict[str, Any] = {}
    for stage in chain:
        settings.update({command.cmd.upper(): command for command in stage[1:]})
    return {**settings, "FROM": chain[0][0].value[0]}


def stage_inputs(name: str) -> set[str]:
    """The stages whose files end up in stage ``name``: it, the stages it is FROM, the ones it mounts or copies
    from (``RUN --mount=...,from=X``, ``COPY --from=X``), and theirs."""
    stages = named_stages()
    found: set[str] = set()
    pending = [name]
    while pending:
        stage = pending.pop()
        if stage in found or stage not in stages:
            continue
        found.add(stage)
        pending.append(stages[stage][0].value[0])
        for command in stages[stage][1:]:
            for flag in command.flags:
                pending += re.findall(r"(?:^--from=|[=,]from=)([^,\s]+)", flag)
    return found


def test_dockerfile_runtime_stage() -> None:
    stages = dockerfile_stages()
    assert stages[-1][0].value[-1] == "proxy", "the last stage (what `docker build .` makes) is the proxy"
    final = stage_settings("proxy")
    assert base_image("proxy") == dockerfile_args()["PYTHON_IMAGE"]
    user = final["USER"].value[0].split(":")[0]
    assert user not in ("root", "0"), "the image must run as a non-root user"
    healthcheck = " ".join(final["HEALTHCHECK"].value)
    assert final["HEALTHCHECK"].value[0] == "CMD" and "/healthz" in healthcheck
    assert final["ENTRYPOINT"].value == ("prefix-proxy",) and final["CMD"].value == ("serve",)
    assert final["EXPOSE"].value == ("8080",)


def test_dockerfile_fake_backend_target() -> None:
    fake = stage_settings("fake-backend")
    assert base_image("fake-backend") == dockerfile_args()["PYTHON_IMAGE"]
    assert fake["USER"].value[0].split(":")[0] not in ("root", "0"), "the image must run as a non-root user"
    assert fake["ENTRYPOINT"].value == ("prefix-proxy",)
    assert fake["CMD"].value == ("fake-backend", "--host", "0.0.0.0", "--port", "8000")
    assert fake["EXPOSE"].value == ("8000",)
    assert fake["HEALTHCHECK"].value[0] == "CMD" and "127.0.0.1:8000/health'" in " ".join(fake["HEALTHCHECK"].value)


def copied_sources(stages: set[str]) -> set[str]:
    named = named_stages()
    return {
        source
        for stage in stages
        for command in named[stage][1:]
        if command.cmd.upper() == "COPY" and not any(flag.startswith("--from") for flag in command.flags)
        for source in command.value[:-1]
    }


def test_the_product_image_does_not_carry_testbed() -> None:
    product = stage_inputs("proxy")
    assert "build" in product and "fake-backend" not in product and "build-fake-backend" not in product
    assert copied_sources(product) == {"pyproject.toml", "constraints.txt", "README.md", "proxy", "summarizer"}
    # The development tooling goes into the fake-backend target only.
    assert "testbed" in copied_sources(stage_inputs("fake-backend"))


def test_dockerfile_copies_only_what_dockerignore_lets_through() -> None:
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore, ".dockerignore should exclude everything not listed (venvs, caches, .git)"
    for stage in dockerfile_stages():
        for command in stage:
            if command.cmd.upper() == "COPY" and not any(flag.startswith("--from") for flag in command.flags):
                for source in command.value[:-1]:
                    assert source in allowed, f"COPY {source}: excluded by .dockerignore"
                    assert (ROOT / source).exists(), f"COPY {source}: no such file"
    # pyproject.toml builds the package from these; README.md is its readme; constraints.txt pins the dependencies.
    assert {"pyproject.toml", "constraints.txt", "README.md", "proxy", "summarizer"} <= allowed


def test_env_example_lists_only_variables_the_compose_file_reads() -> None:
    text = COMPOSE.read_text()
    variables = re.findall(r"^#? ?([A-Z][A-Z0-9_]+)=", (DEPLOY / ".env.example").read_text(), re.MULTILINE)
    assert variables
    unused = [name for name in variables if "${" + name not in text]
    assert not unused, f"deploy/.env.example names variables docker-compose.yml never reads: {unused}"


# -- topologies: Redis Cluster, a router behind the proxy ------------------------------------------

TOPOLOGIES = K8S / "topologies"
COMPOSE_OVERRIDES = DEPLOY / "compose"


def topology_docs() -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{path.name}:{doc['kind']}", doc)
        for path in sorted(TOPOLOGIES.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


@pytest.mark.parametrize("name", [name for name, _ in topology_docs()])
def test_topology_manifests_validate_against_the_kubernetes_schema(name: str) -> None:
    doc = dict(topology_docs())[name]
    validate_k8s(doc, "latest")
    assert doc["metadata"]["namespace"] == "prefix-proxy"


def test_redis_cluster_topology_is_a_cluster_of_three_masters_with_replicas() -> None:
    docs = {doc["kind"]: doc for _, doc in topology_docs() if doc["metadata"]["name"].startswith("redis-cluster")}
    statefulset, service, job = docs["StatefulSet"], docs["Service"], docs["Job"]
    assert service["spec"]["clusterIP"] == "None" and statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    assert statefulset["spec"]["replicas"] == 6
    assert "--cluster-enabled yes" in statefulset["spec"]["template"]["spec"]["containers"][0]["args"][0]
    create = job["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert create.count(":6379") == 6 and "--cluster-replicas 1" in create


def compose_override(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((COMPOSE_OVERRIDES / name).read_text())
    return data


def merged(override: dict[str, Any]) -> dict[str, Any]:
    """The main compose file with an override file on top (compose merges maps, appends lists)."""

    def merge(base: Any, top: Any) -> Any:
        if isinstance(base, dict) and isinstance(top, dict):
            return {
                key: merge(base[key], top[key]) if key in base and key in top else top.get(key, base.get(key))
                for key in {**base, **top}
            }
        return top

    return {key: value for key, value in merge(compose(), override).items() if not key.startswith("x-")}


@pytest.mark.parametrize("name", ["redis-cluster.yml", "router.yml"])
def test_compose_topologies_validate_against_the_compose_spec(name: str) -> None:
    validator = jsonschema.Draft202012Validator(compose_schema())
    document = interpolate(merged(compose_override(name)), {})
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]
    assert not errors, errors
    services = document["services"]
    for service in services.values():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"depends on a service that does not exist: {dependency}"


@pytest.mark.parametrize("name", ["redis-cluster.yml", "router.yml"])
def test_compose_topologies_configure_the_proxy_with_known_settings(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    environment = interpolate(merged(compose_override(name)), {})["services"]["proxy"]["environment"]
    for key in [k for k in os.environ if k.startswith("PREFIX_PROXY_")]:
        monkeypatch.delenv(key)
    for key, value in environment.items():
        if key != "PREFIX_PROXY_CONFIG":
            monkeypatch.setenv(key, str(value))
    settings = Settings()
    if name == "redis-cluster.yml":
        assert settings.sessions.redis_cluster and settings.replicas.share_memories
        assert settings.sessions.redis_url == "redis://redis-0:6379/0"
    else:
        assert settings.routing.key_headers == ["x-session-id"]
        assert settings.upstream == "http://router:8000/v1"
