"""Where the real engine gets its chat template and its replies: the fake backend.

`proxy.enginemodel.chat_template.QWEN_STYLE_CHAT_TEMPLATE` becomes the tokenizer's chat template and
`testbed.fakevllm.replies.reply_for_prompt` decides every reply, so the fake and the real engine render
and answer alike. Used by `build_model.py` and the logits processor, which run in the vLLM venv (the
repo root is put on sys.path here), and by tests in the project venv. Needs `tokenizers` only.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
EOS_TOKEN = "<|im_end|>"
TEMPLATE_MODULE = "proxy.enginemodel.chat_template"
REPLIES_MODULE = "testbed.fakevllm.replies"


def _import(module_name: str) -> Any:
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(
            f"cannot import {module_name} from {REPO_ROOT} ({exc}); the real engine takes its chat "
            "template and replies from the fake backend, and needs its dependencies (xxhash, tiktoken, orjson) "
            "in the vLLM venv"
        ) from exc


def load_chat_template() -> tuple[str, str]:
    """(template, where it came from)."""
    template: str = _import(TEMPLATE_MODULE).QWEN_STYLE_CHAT_TEMPLATE
    return template, f"{TEMPLATE_MODULE}.QWEN_STYLE_CHAT_TEMPLATE"


def load_reply_fn() -> tuple[Callable[..., str], str]:
    """(reply_for_prompt, where it came from)."""
    return _import(REPLIES_MODULE).reply_for_prompt, f"{REPLIES_MODULE}.reply_for_prompt"


class EngineTokenizer:
    """The served model's tokenizer in the shape of the fake backend's ``ChatTokenizer`` protocol
    (``name``, ``eos_token_id``, ``encode``, ``decode`` keeping special tokens), so that
    ``reply_for_prompt(..., tokenizer=...)`` truncates to ``max_tokens`` of the engine's own tokens."""

    def __init__(self, model_dir: str | Path, tokenizer: Any = None) -> None:
        if tokenizer is None:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self._tokenizer = tokenizer
        self.name = str(Path(model_dir) / "tokenizer.json")
        eos = tokenizer.token_to_id(EOS_TOKEN)
        if eos is None:
            raise ValueError(f"{self.name} has no {EOS_TOKEN!r} token")
        self.eos_token_id: int = eos

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self._tokenizer.decode(list(ids), skip_special_tokens=False)
        return text


def reply_kwargs(reply_fn: Callable[..., str], tokenizer: EngineTokenizer) -> dict[str, Any]:
    """Pass the engine's tokenizer when the reply function accepts one (for max_tokens truncation)."""
    return {"tokenizer": tokenizer} if "tokenizer" in inspect.signature(reply_fn).parameters else {}


def expected_reply(model_dir: str | Path, prompt_ids: Sequence[int], max_tokens: int | None) -> str:
    """The text the engine is forced to answer for these prompt ids (what `forced_reply` computes)."""
    tokenizer = EngineTokenizer(model_dir)
    reply_fn, _ = load_reply_fn()
    return str(reply_fn(tokenizer.decode(prompt_ids), max_tokens, **reply_kwargs(reply_fn, tokenizer)))
