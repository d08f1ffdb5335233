"""What distinct tool lists hold is bounded in bytes and released once idle: a tenant sending a new
300-tool list on every request cannot pin memory that is never given back."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from proxy.canon import tools as canon_tools
from proxy.canon.tools import canonicalize_tool_fields
from proxy.openai import jsonio, shared_json

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "tools"


def _tool_list(i: int) -> list[Any]:
    """300 tools of real size: BFCL's where the shared data is here, else as long made up."""
    base = (
        [tool for path in sorted(DATA.glob("*.json")) for tool in json.loads(path.read_text())] if DATA.is_dir() else []
    )
    if not base:
        schema = {
            "type": "object",
            "properties": {f"arg{k}": {"type": "string", "description": "x" * 60} for k in range(6)},
        }
        base = [{"type": "function", "function": {"name": "t", "description": "d" * 600, "parameters": schema}}]
    tools = copy.deepcopy((base * 300)[:300])
    for j, tool in enumerate(tools):
        tool["function"]["name"] = f"{tool['function']['name']}_{i}_{j}"
    return tools


def test_distinct_tool_lists_hold_a_bounded_number_of_bytes() -> None:
    for i in range(120):
        tools = _tool_list(i)
        shared_json(tools)
        canonicalize_tool_fields({"tools": tools})
    assert canon_tools._canonical_forms.currsize <= canon_tools.CANONICAL_FORMS_BYTES
    assert jsonio._SHARED.currsize <= jsonio.SHARED_BYTES
    assert len(canon_tools._canonical_forms) < 120  # the oldest went


def test_idle_tool_lists_are_released(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    forms = canon_tools.TTLCache(
        canon_tools.CANONICAL_FORMS_BYTES, 10.0, timer=lambda: now[0], getsizeof=lambda e: e[2]
    )
    shared = jsonio.TTLCache(jsonio.SHARED_BYTES, 10.0, timer=lambda: now[0], getsizeof=jsonio._SHARED.getsizeof)
    monkeypatch.setattr(canon_tools, "_canonical_forms", forms)
    monkeypatch.setattr(jsonio, "_SHARED", shared)
    tools = _tool_list(0)
    shared_json(tools)
    canonicalize_tool_fields({"tools": tools})
    assert len(forms) == 1 and len(shared) == 1
    now[0] += 5
    canonicalize_tool_fields({"tools": tools})  # in use: its idle time starts again
    now[0] += 8
    canon_tools.expire_idle()
    jsonio.expire_idle()
    assert len(forms) == 1 and len(shared) == 0
    now[0] += 11
    canon_tools.expire_idle()
    assert len(forms) == 0
