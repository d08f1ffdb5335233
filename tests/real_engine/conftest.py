"""One real vLLM (CPU build) per test session, shared by every test under tests/real_engine.

Start-up costs about a minute (several more the first time, when `bench/real_vllm/setup.py` installs
vLLM and builds the model), so tests share the `real_vllm` fixture instead of starting their own.

REAL_VLLM_NO_INSTALL=1: skip instead of installing. REAL_VLLM_REQUIRED=1: fail instead of skipping
when the engine cannot be installed here. REAL_VLLM_PRESET: model preset (default tiny).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

from bench.real_vllm.engine import DEFAULT_PRESET, RealVLLM, unavailable_reason


@pytest.fixture(scope="session")
def real_vllm() -> Iterator[RealVLLM]:
    preset = os.environ.get("REAL_VLLM_PRESET", DEFAULT_PRESET)
    why = unavailable_reason(install=os.environ.get("REAL_VLLM_NO_INSTALL") != "1", preset=preset)
    if why:
        if os.environ.get("REAL_VLLM_REQUIRED") == "1":
            pytest.fail(f"real vLLM unavailable: {why}")
        pytest.skip(f"real vLLM unavailable: {why}")
    # Stored responses (previous_response_id, GET /v1/responses/{id}) need vLLM's in-process store.
    with RealVLLM(preset=preset, extra_env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"}) as engine:
        print(
            f"\nreal vLLM ({preset}) healthy after {engine.startup_seconds:.1f}s at {engine.base_url}", file=sys.stderr
        )
        yield engine
