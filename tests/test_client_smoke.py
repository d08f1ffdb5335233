"""One real client in CI: Claude Code (npm), two turns through the proxy to the fake backend over real HTTP.

The install is cached under bench/clients/.work (``python -m bench.clients`` shares it), so a re-run
only starts the client. Skipped, with the reason, where npm or the npm registry cannot be reached.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from bench.clients.clients import ClaudeCode
from bench.clients.install import Unavailable
from bench.clients.run import fake_backend, run_client


def _claude_code() -> Path:
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip("node/npm are not installed")
    try:
        return ClaudeCode().install()
    except Unavailable as exc:
        try:
            httpx.get("https://registry.npmjs.org/-/ping", timeout=10).raise_for_status()
        except httpx.HTTPError as unreachable:
            pytest.skip(f"the npm registry is unreachable ({unreachable}); install failed: {exc}")
        raise


def test_claude_code_two_turns_through_the_proxy(tmp_path: Path) -> None:
    binary = _claude_code()
    with fake_backend() as backend:
        result = run_client(
            ClaudeCode(), binary, backend, mode="proxy", turns=2, commits=False, turn_timeout=180, log_dir=tmp_path
        )
    turns = [(t.turn, t.exit_code, t.output_tail[-300:]) for t in result.turns]
    assert all(t.exit_code == 0 for t in result.turns), turns
    assert result.generation_requests >= 2, result.paths
    assert result.http_errors == 0, result.error_samples
    assert result.foreign == [], result.foreign
    # The second turn re-sends the first: the backend's prefix cache serves it.
    assert result.prompt_tokens > 0 and result.cached_tokens > 0, (result.prompt_tokens, result.cached_tokens)
