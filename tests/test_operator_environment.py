"""What a pod's environment gives the proxy, as an operator deploys it: configurations that
check-config passed and serve then failed or mishandled (an operator-deployment review).

A private CA named by SSL_CERT_FILE, a password with an unencoded URL delimiter, a host name with
an IPv6 address only, an inherited PROMETHEUS_MULTIPROC_DIR, a section variable beside the file's
keys, and the compose stack's config file.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from proxy.backends.upstream import Upstream
from proxy.config_sources import ConfigError, masked_url
from proxy.preflight import check_settings, load_settings
from proxy.serve import listen
from testbed.serving import free_port
from tests.helpers import require_executable, wait_healthy
from tests.test_operator_config import config_file, run_cli


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("PREFIX_PROXY_"):
            monkeypatch.delenv(name)


# -- 1. tests/test_backends.py: an https upstream whose CA the pod trusts ---------------------------------------


def _tls_model_server(tmp_path: Path) -> tuple[HTTPServer, Path]:
    openssl = require_executable("openssl", "apt-get install openssl")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True,
    )  # fmt: skip

    class Models(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"object": "list", "data": [{"id": "m", "max_model_len": 4096}]}'
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Models)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, cert


def test_an_https_upstream_signed_by_a_ca_the_environment_trusts_is_reached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SSL_CERT_FILE is how a pod is told to trust a private CA (redis-py's rediss:// honours it in
    this very process); the upstream client must honour it too (or offer a CA-bundle setting)."""
    server, cert = _tls_model_server(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    upstream = Upstream(f"https://127.0.0.1:{server.server_port}/v1")

    async def models() -> object:
        try:
            return await upstream.get_models(timeout_s=5)
        finally:
            await upstream.aclose()

    try:
        response = asyncio.run(models())
    finally:
        server.shutdown()
    assert response is not None, "the upstream's certificate was refused: SSL_CERT_FILE is ignored"
    assert response.status_code == 200  # type: ignore[attr-defined]


# -- 2. tests/test_config_checks.py: a password never reaches a problem line -------------------------------------

PASSWORD = "Zx9kQ2vLm"


@pytest.mark.parametrize(
    ("variable", "url"),
    [
        ("PREFIX_PROXY_SESSIONS__REDIS_URL", f"redis://:{PASSWORD[:3]}#{PASSWORD[3:]}@redis.redis.svc:6379/0"),
        ("PREFIX_PROXY_SESSIONS__REDIS_URL", f"redis://:{PASSWORD[:3]}/{PASSWORD[3:]}@redis.redis.svc:6379/0"),
        ("PREFIX_PROXY_SESSIONS__REDIS_URL", f"redis://default:{PASSWORD[:3]}?{PASSWORD[3:]}@redis.redis.svc:6379/0"),
        ("PREFIX_PROXY_UPSTREAM", f"http://user:{PASSWORD[:3]}#{PASSWORD[3:]}@vllm:8000/v1"),
    ],
)
def test_a_password_with_a_url_delimiter_is_not_echoed(
    monkeypatch: pytest.MonkeyPatch, variable: str, url: str
) -> None:
    """A generated password holding '#', '?' or '/' (not percent-encoded) makes the URL invalid:
    the problem line must say so without printing the password (serve prints it to the pod's log)."""
    monkeypatch.setenv("PREFIX_PROXY_SESSIONS__STORE", "redis")
    monkeypatch.setenv(variable, url)
    _, found, _ = check_settings(None)
    assert found, "expected a problem with this URL"
    for line in found:
        assert PASSWORD[3:] not in line and PASSWORD[:3] not in line, line
    assert PASSWORD[3:] not in masked_url(url)


# -- 3. tests/test_config_checks.py: the listen host is bound as it was checked ----------------------------------


def test_a_listen_host_name_with_only_an_ipv6_address_is_bound_as_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """An IPv6-only cluster: the pod's name resolves to an IPv6 address only. check-config's probe
    (getaddrinfo, every family) accepts it; serve must bind it too, not refuse it blaming 'port'."""
    real = socket.getaddrinfo

    def resolve(host: object, *args: object, **kwargs: object) -> object:
        return real("::1" if host == "v6only.test" else host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    settings = load_settings(None, host="v6only.test", port=free_port())  # check-config: OK
    try:
        sock = listen(settings.host, settings.port, "port")
    except ConfigError as error:
        pytest.fail(f"check-config accepted host v6only.test, serve refuses it: {error}")
    sock.close()
    assert sock.family == socket.AF_INET6


# -- 4. tests/test_config_checks.py: an inherited PROMETHEUS_MULTIPROC_DIR ----------------------------------------


def test_serve_starts_or_check_config_refuses_with_a_prometheus_multiprocess_dir(tmp_path: Path) -> None:
    """prometheus_client switches to file-backed values when PROMETHEUS_MULTIPROC_DIR is set (base
    images for gunicorn apps set it): check-config passes, then serve dies with a traceback when
    the folder is absent (or the root filesystem read-only)."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.upper().startswith("PREFIX_PROXY_")},
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "absent"),
        "PREFIX_PROXY_UPSTREAM": "http://127.0.0.1:9/v1",
    }
    check = run_cli("check-config", env=env, cwd=tmp_path)
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--port", str(port)],
        env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        started = wait_healthy(f"http://127.0.0.1:{port}", timeout_s=20)
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)
    assert "Traceback" not in stderr, stderr[-600:]
    assert started or check.returncode == 2, (check.returncode, stderr[-300:])


# -- 5. tests/test_config_checks.py: check-config names where each value came from ------------------------------


def test_a_section_variable_does_not_claim_the_files_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = config_file(tmp_path, "canon:\n  mode: safe\n")
    monkeypatch.setenv("PREFIX_PROXY_CANON", '{"relocate_target": "system_end"}')
    lines, found, _ = check_settings(path)
    assert not found
    assert f'canon.mode = "safe"  [{path}: canon.mode]' in lines, [x for x in lines if x.startswith("canon.mode")]


# -- 6. tests/test_deploy.py: deploy/proxy.yaml holds no key the compose stack always overrides ------------------


def _flat(data: dict, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    keys: set[tuple[str, ...]] = set()
    for key, value in data.items():
        keys |= _flat(value, (*prefix, key)) if isinstance(value, dict) else {(*prefix, key)}
    return keys


def test_the_compose_config_file_holds_no_key_its_environment_always_replaces() -> None:
    """deploy/proxy.yaml is the compose stack's config file: a key there that the proxy service's
    environment always sets (the environment wins) is one an operator edits to no effect."""
    import yaml

    root = Path(__file__).resolve().parents[1]
    compose = yaml.safe_load((root / "deploy/docker-compose.yml").read_text())
    environment = compose["services"]["proxy"]["environment"]
    from_env = {
        tuple(name.removeprefix("PREFIX_PROXY_").lower().split("__"))
        for name in environment
        if name != "PREFIX_PROXY_CONFIG"
    }
    in_file = _flat(yaml.safe_load((root / "deploy/proxy.yaml").read_text()))
    assert not (in_file & from_env), sorted(".".join(k) for k in in_file & from_env)


def test_a_redis_that_refuses_the_database_is_told_apart_from_one_that_does_not_answer(tmp_path: Path) -> None:
    """redis://HOST/16 on a server with 16 databases (0-15): Redis answers "ERR DB index is out of
    range" on every connection. check-config passes; serve's start-up warning must say why, not that
    the store "does not answer" (the operator goes looking for a network problem)."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.upper().startswith("PREFIX_PROXY_")},
        "PREFIX_PROXY_UPSTREAM": "http://127.0.0.1:9/v1",
        "PREFIX_PROXY_SESSIONS__STORE": "redis",
        "PREFIX_PROXY_SESSIONS__REDIS_URL": "redis://127.0.0.1:6379/16",
    }
    assert run_cli("check-config", env=env, cwd=tmp_path).returncode == 0
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--port", str(port)],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert wait_healthy(f"http://127.0.0.1:{port}", timeout_s=20)
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=30)
    (line,) = [line for line in output.splitlines() if "session store redis at" in line]
    assert "does not answer" not in line and "DB index is out of range" in line, line
    assert "answered with an error (ResponseError: DB index is out of range)" in line


def test_a_missing_ssl_cert_file_is_one_line_from_check_config_and_serve(tmp_path: Path) -> None:
    """SSL_CERT_FILE naming nothing: the upstream client failed to build (FileNotFoundError in serve's
    traceback, an http upstream included) while check-config said OK. Both now name the variable."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.upper().startswith("PREFIX_PROXY_")},
        "SSL_CERT_FILE": str(tmp_path / "absent.pem"),
        "PREFIX_PROXY_UPSTREAM": "http://127.0.0.1:9/v1",
    }
    expected = f"SSL_CERT_FILE={tmp_path / 'absent.pem'}: the upstream client cannot load it (No such file"
    for command in (["check-config"], ["serve", "--port", str(free_port())]):
        result = run_cli(*command, env=env, cwd=tmp_path)
        assert result.returncode == 2, (command, result.stderr[-400:])
        assert "Traceback" not in result.stderr and expected in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        # Cloudflare's model names hold an '@' in the path: no user part, the URL as written.
        (
            "https://gateway.ai.cloudflare.com/v1/acct/gw/workers-ai/@cf/meta/llama",
            "https://gateway.ai.cloudflare.com/v1/acct/gw/workers-ai/@cf/meta/llama",
        ),
        ("http://user:pw@gw:8000/v1?owner=a@b", "http://user:***@gw:8000/v1?owner=a@b"),
        ("redis://default:1234#abc@redis:6379/0", "redis://default:***@redis:6379/0"),  # a port? no: masked
    ],
)
def test_masked_url_keeps_the_host_and_masks_where_unsure(url: str, expected: str) -> None:
    assert masked_url(url) == expected
