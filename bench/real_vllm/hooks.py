"""Where the real engine gets its chat template and its reply function.

Both come from the fake backend (`proxy/fakebackend/template.py`, `proxy/fakebackend/replies.py`) so
that the fake and the real engine render and answer alike. This module runs inside the vLLM
virtual environment (model build, server process), which does not have the proxy's dependencies:
a module is imported normally when that works, else loaded straight from its file (it must then be
self-contained), and the stand-ins in `_fallback.py` are used only while the file does not exist.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]

ReplyFn = Callable[[str, "int | None"], str]


def _load(module_name: str) -> ModuleType | None:
    """Import `proxy.fakebackend.<x>`; None when its file does not exist."""
    rel = Path(*module_name.split(".")).with_suffix(".py")
    path = REPO_ROOT / rel
    if not path.is_file():
        return None
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    try:
        return importlib.import_module(module_name)
    except ImportError:
        # The package's __init__ may pull in dependencies this venv lacks: load the file alone.
        spec = importlib.util.spec_from_file_location(f"_real_vllm_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


def load_chat_template() -> tuple[str, str]:
    """(template, where it came from)."""
    module = _load("proxy.fakebackend.template")
    if module is not None:
        return module.QWEN_STYLE_CHAT_TEMPLATE, "proxy.fakebackend.template.QWEN_STYLE_CHAT_TEMPLATE"
    return _fallback().QWEN25_CHAT_TEMPLATE, "bench/real_vllm/_fallback.py (stand-in)"


def load_reply_fn() -> tuple[Any, str]:
    """(reply_for_prompt, where it came from)."""
    module = _load("proxy.fakebackend.replies")
    if module is not None:
        return module.reply_for_prompt, "proxy.fakebackend.replies.reply_for_prompt"
    fallback = _fallback()
    return fallback.reply_for_prompt, "bench/real_vllm/_fallback.py (placeholder)"


def _fallback() -> ModuleType:
    here = Path(__file__).resolve().parent / "_fallback.py"
    spec = importlib.util.spec_from_file_location("_real_vllm_fallback", here)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
