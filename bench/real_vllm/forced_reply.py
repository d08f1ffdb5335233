"""vLLM (v1 model runner) logits processor that makes the random-weight model answer deterministically.

Loaded by the server with
``--logits-processors bench.real_vllm.forced_reply:ForcedReplyLogitsProcessor`` and the repo root on
PYTHONPATH. For every request it decodes the prompt token ids (special tokens kept, so the text is the
rendered chat prompt), asks ``reply_for_prompt(prompt_text, max_tokens)`` (the fake backend's function,
see ``hooks.py``) for the reply text, encodes it and then, step by step, leaves only the next token of
that encoding (then ``<|im_end|>``) selectable. Whatever the sampling parameters, the engine emits those
ids; vLLM's own tokenizer, chat template, scheduler, prefix cache, detokenizer and tool parser do the rest.

Requests with structured outputs (``response_format``, ``tool_choice="required"`` or a named tool) are
left alone: forcing text against a grammar would break vLLM's grammar state.

This module imports vLLM and runs only in the vLLM virtual environment.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

if TYPE_CHECKING:
    from vllm.config import VllmConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hooks import load_reply_fn  # noqa: E402

logger = logging.getLogger("vllm.forced_reply")

EOS_TOKEN = "<|im_end|>"


class _EngineTokenizer:
    """The served model's tokenizer in the shape the fake backend's ChatTokenizer protocol has,
    so that ``reply_for_prompt`` truncates to ``max_tokens`` of *these* tokens."""

    def __init__(self, tokenizer: Tokenizer, path: str, eos_token_id: int) -> None:
        self._tokenizer = tokenizer
        self.name = path
        self.eos_token_id = eos_token_id

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self._tokenizer.decode(list(ids), skip_special_tokens=False)
        return text


class ForcedReplyLogitsProcessor(LogitsProcessor):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        tokenizer_dir = Path(vllm_config.model_config.tokenizer)
        self.tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        eos = self.tokenizer.token_to_id(EOS_TOKEN)
        if eos is None:
            raise RuntimeError(f"{EOS_TOKEN} is not in {tokenizer_dir / 'tokenizer.json'}")
        self.eos_id: int = eos
        self.reply_fn, source = load_reply_fn()
        self.reply_kwargs: dict[str, object] = {}
        if "tokenizer" in inspect.signature(self.reply_fn).parameters:
            self.reply_kwargs["tokenizer"] = _EngineTokenizer(
                self.tokenizer, str(tokenizer_dir / "tokenizer.json"), eos
            )
        self.device = device
        # batch index -> (forced ids, live reference to the request's output ids)
        self.forced: dict[int, tuple[list[int], Sequence[int]]] = {}
        self.debug = os.environ.get("FORCED_REPLY_DEBUG") == "1"
        logger.info("forced replies from %s, eos id %d", source, self.eos_id)

    def is_argmax_invariant(self) -> bool:
        return False

    def _new_state(
        self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> tuple[list[int], Sequence[int]] | None:
        if prompt_ids is None or params.structured_outputs is not None:
            return None
        prompt_text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        reply = self.reply_fn(prompt_text, params.max_tokens, **self.reply_kwargs)
        ids = self.tokenizer.encode(reply, add_special_tokens=False).ids + [self.eos_id]
        if self.debug:
            logger.info("forced reply (%d ids) for a %d-token prompt: %r", len(ids), len(prompt_ids), reply)
        return ids, output_ids

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.forced, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.forced:
            return logits
        rows: list[int] = []
        targets: list[int] = []
        for index, (ids, output_ids) in self.forced.items():
            if index >= logits.shape[0]:
                continue
            pos = len(output_ids)
            rows.append(index)
            targets.append(ids[pos] if pos < len(ids) else self.eos_id)
        if rows:
            row_t = torch.tensor(rows, dtype=torch.long, device=logits.device)
            tgt_t = torch.tensor(targets, dtype=torch.long, device=logits.device)
            logits[row_t] = float("-inf")
            logits[row_t, tgt_t] = 0.0
        return logits
