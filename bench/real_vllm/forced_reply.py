"""vLLM (v1 model runner) logits processor that makes the random-weight model answer deterministically.

Loaded by the server with
``--logits-processors bench.real_vllm.forced_reply:ForcedReplyLogitsProcessor`` and the repo root on
PYTHONPATH. For every request it decodes the prompt token ids (special tokens kept, so the text is the
rendered chat prompt), asks ``reply_for_prompt(prompt_text, max_tokens)`` (the fake backend's function,
see ``hooks.py``) for the reply text, encodes it and then, step by step, leaves only the next token of
that encoding (then ``<|im_end|>``) selectable. Whatever the sampling parameters, the engine emits those
ids; vLLM's own tokenizer, chat template, scheduler, prefix cache, detokenizer and tool parser do the rest.

Requests with structured outputs (``response_format``, ``tool_choice="required"`` or a named tool) run
under a grammar, whose mask is applied before this processor: the reply is forced only while each of its
tokens is one the grammar allows (a tool-call reply under ``tool_choice="required"`` fits); at the first
token it forbids, forcing stops for that request and the grammar-constrained random model finishes it
(valid, but not deterministic). Forcing a forbidden token would make vLLM abort the request.

This module imports vLLM and runs only in the vLLM virtual environment.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
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
from hooks import EngineTokenizer, load_reply_fn, reply_kwargs

logger = logging.getLogger("vllm.forced_reply")

EOS_TOKEN = "<|im_end|>"


@dataclass
class _Forced:
    ids: list[int]  # the reply's token ids, then EOS
    output_ids: Sequence[int]  # live reference to the request's generated ids
    grammar: bool  # the request has structured outputs
    diverged: bool = False  # the grammar refused the reply; no more forcing


class ForcedReplyLogitsProcessor(LogitsProcessor):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        tokenizer_dir = Path(vllm_config.model_config.tokenizer)
        self.tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
        eos = self.tokenizer.token_to_id(EOS_TOKEN)
        if eos is None:
            raise RuntimeError(f"{EOS_TOKEN} is not in {tokenizer_dir / 'tokenizer.json'}")
        self.eos_id: int = eos
        self.reply_fn, source = load_reply_fn()
        self.reply_kwargs = reply_kwargs(self.reply_fn, EngineTokenizer(tokenizer_dir, self.tokenizer))
        self.device = device
        # batch index -> forced reply state
        self.forced: dict[int, _Forced] = {}
        self.debug = os.environ.get("FORCED_REPLY_DEBUG") == "1"
        logger.info("forced replies from %s, eos id %d", source, self.eos_id)

    def is_argmax_invariant(self) -> bool:
        return False

    def _new_state(self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]) -> _Forced | None:
        if prompt_ids is None:
            return None
        prompt_text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        try:
            reply = self.reply_fn(prompt_text, params.max_tokens, **self.reply_kwargs)
        except Exception as exc:  # keep the engine up; the odd reply makes the failure visible
            logger.exception("reply_for_prompt failed")
            reply = f"[reply_for_prompt failed: {type(exc).__name__}: {exc}]"
        ids = [*self.tokenizer.encode(reply, add_special_tokens=False).ids, self.eos_id]
        if self.debug:
            logger.info("forced reply (%d ids) for a %d-token prompt: %r", len(ids), len(prompt_ids), reply)
        return _Forced(ids, output_ids, params.structured_outputs is not None)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.forced, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.forced:
            return logits
        rows: list[int] = []
        targets: list[int] = []
        for index, state in self.forced.items():
            if index >= logits.shape[0] or state.diverged:
                continue
            pos = len(state.output_ids)
            target = state.ids[pos] if pos < len(state.ids) else self.eos_id
            if state.grammar and logits[index, target].item() == float("-inf"):
                state.diverged = True  # the grammar forbids the reply's next token: let it decide
                continue
            rows.append(index)
            targets.append(target)
        if rows:
            row_t = torch.tensor(rows, dtype=torch.long, device=logits.device)
            tgt_t = torch.tensor(targets, dtype=torch.long, device=logits.device)
            logits[row_t] = float("-inf")
            logits[row_t, tgt_t] = 0.0
        return logits
