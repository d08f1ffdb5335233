"""vLLM's incremental detokenizer: the text a stream of generated tokens adds, token by token."""

from __future__ import annotations

from collections.abc import Sequence

from proxy.enginemodel import ChatTokenizer


def token_text_deltas(tokenizer: ChatTokenizer, ids: Sequence[int]) -> list[str]:
    """The text each generated token adds, as vLLM's incremental detokenizer streams it.

    A token that ends inside a multi-byte character contributes ``""`` and its bytes come out
    with a later token; the deltas always concatenate to the decoded text once it is complete.
    Decoding a sliding window keeps this linear in the number of tokens.
    """
    deltas: list[str] = []
    prefix_offset = 0
    read_offset = 0
    for end in range(1, len(ids) + 1):
        prefix_text = tokenizer.decode(ids[prefix_offset:read_offset])
        new_text = tokenizer.decode(ids[prefix_offset:end])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            deltas.append(new_text[len(prefix_text) :])
            prefix_offset, read_offset = read_offset, end
        else:
            deltas.append("")
    return deltas
