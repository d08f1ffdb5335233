"""Settings of one fake vLLM server."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class FakeBackendConfig:
    """How the fake backend presents itself and how much it pretends compute costs.

    Timing knobs make time-to-first-token reflect cache misses: a request sleeps
    ``prefill_seconds_per_token`` for every prompt token it did not get from the prefix cache,
    then ``seconds_per_output_token`` between generated tokens. (A CLI flag in ms per 1k
    prompt tokens converts as ``prefill_seconds_per_token = ms / 1e6``.)
    """

    model: str = "fake-model"
    # Names the server answers to (vLLM's --served-model-name); empty means [model].
    served_model_names: list[str] = field(default_factory=list)
    block_size: int = 16
    cache_capacity_blocks: int = 65536
    max_model_len: int = 32768
    # vLLM 0.32 clamps max_tokens to what the context leaves after the prompt and refuses only a
    # prompt that leaves no room (seen with Claude Code's max_tokens 32000 on a 32k model). False:
    # refuse prompt + max_tokens over max_model_len, as older releases did.
    clamp_max_tokens: bool = True
    # A Hugging Face tokenizer.json (or a directory holding one); None: bundled cl100k + ChatML.
    tokenizer_path: str | None = None
    eos_token: str = "<|im_end|>"
    prefill_seconds_per_token: float = 0.0
    seconds_per_output_token: float = 0.0
    # vLLM's --no-enable-prefix-caching when False.
    enable_prefix_caching: bool = True
    # How usage reports a miss: "omit" drops prompt_tokens_details (what clients must treat as
    # 0), "null" sends null (vLLM without --enable-prompt-tokens-details), "zero" sends
    # {"cached_tokens": 0}.
    zero_cached_tokens_details: Literal["omit", "null", "zero"] = "omit"
    request_log_size: int = 256
    embedding_dim: int = 256
    # False: refuse a system message anywhere but first, as Mistral's and Gemma's chat templates
    # do (vLLM answers 400 with the template's own message).
    system_anywhere: bool = True
    # Keep /v1/responses answers for previous_response_id and GET, in process: vLLM started with
    # VLLM_ENABLE_RESPONSES_API_STORE=1 (without it vLLM ignores "store" and chains get 404).
    responses_store: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.cache_capacity_blocks < 1 or self.max_model_len < 1:
            raise ValueError("block_size, cache_capacity_blocks and max_model_len must be positive")
        if self.prefill_seconds_per_token < 0 or self.seconds_per_output_token < 0:
            raise ValueError("timing knobs must not be negative")

    @property
    def model_names(self) -> list[str]:
        return list(self.served_model_names) or [self.model]

    @property
    def response_model(self) -> str:
        """The model name answers carry: vLLM answers with its first served name."""
        return self.model_names[0]

    @property
    def metrics_model_name(self) -> str:
        return self.model_names[0]
