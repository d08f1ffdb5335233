"""Build the small random-weight Llama and its tokenizer that the real vLLM serves.

Run with the vLLM venv's Python (it needs `transformers`, `tokenizers` and `torch`):

    bench/real_vllm/.work/venv/bin/python bench/real_vllm/build_model.py [--out DIR] [--force]

Everything is derived from fixed inputs (seed, generated text, the files under shared/data, the chat
template): the same inputs give byte-identical files. `build_info.json` records the inputs' digest;
a re-run with the same digest does nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from hooks import load_chat_template  # noqa: E402

BUILD_VERSION = 1  # bump when this script's output changes for the same inputs
SEED = 1234
VOCAB_TARGET = 8192
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2.5 keeps these as added, non-special tokens: they survive skip_special_tokens, and vLLM's
# hermes tool parser looks their ids up in the vocabulary.
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
_COMMON_SHAPE = {
    "max_position_embeddings": 32768,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
# "small": ~57M params. "tiny": ~13M params, about 4x cheaper per token (prefill and decode).
PRESETS: dict[str, dict[str, object]] = {
    "small": {
        "hidden_size": 768,
        "num_hidden_layers": 8,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "intermediate_size": 2048,
        **_COMMON_SHAPE,
    },
    "tiny": {
        "hidden_size": 384,
        "num_hidden_layers": 6,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "intermediate_size": 1024,
        **_COMMON_SHAPE,
    },
    "micro": {
        "hidden_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 1536,
        **_COMMON_SHAPE,
    },
}
DEFAULT_PRESET = "tiny"
# Qwen2's pre-tokenizer split (letters, single digits, punctuation runs, newlines, spaces).
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


_GENERATED_WORDS = (
    "the a of to and in is you that it for on with as are this be at your can by from or "
    "user assistant system tool function call arguments name description parameters type "
    "object string number integer boolean array required properties query result answer "
    "question context document time date current today please help summary conversation "
    "message response request error value key file path search weather city price order"
)


def model_dir(preset: str = DEFAULT_PRESET) -> Path:
    return HERE / ".work" / f"model-{preset}"


def shared_data_dir() -> Path | None:
    for candidate in (REPO_ROOT.parent / "shared" / "data", Path("/work/shared/data")):
        if candidate.is_dir():
            return candidate
    return None


def _strings(obj: object) -> Iterator[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield str(key)
            yield from _strings(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _strings(value)


def corpus_texts(data_dir: Path | None) -> list[str]:
    """Local text: shared/data (raw and JSON-decoded), then generated text with the shapes
    prompts have (dates, ids, JSON tool calls, the chat markup)."""
    texts: list[str] = []
    if data_dir is not None:
        for path in sorted(p for p in data_dir.rglob("*") if p.is_file()):
            raw = path.read_text(encoding="utf-8", errors="replace")
            texts.append(raw)
            if path.suffix == ".json":
                with contextlib.suppress(ValueError):
                    texts.extend(_strings(json.loads(raw)))
            elif path.suffix == ".jsonl":
                for line in raw.splitlines():
                    with contextlib.suppress(ValueError):
                        texts.extend(_strings(json.loads(line)))
    rng = random.Random(SEED)
    words = _GENERATED_WORDS.split()
    for _ in range(4000):
        n = rng.randint(5, 25)
        sentence = " ".join(rng.choice(words) for _ in range(n)).capitalize() + rng.choice(".?!")
        texts.append(sentence)
        texts.append(
            f"{rng.randint(1990, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
            f"T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z "
            f"{rng.getrandbits(128):032x} {rng.randint(0, 10**6)} {rng.random():.4f}"
        )
        args = {rng.choice(words): rng.choice(words), rng.choice(words): rng.randint(0, 999)}
        call = {"name": f"{rng.choice(words)}_{rng.choice(words)}", "arguments": args}
        texts.append(f"<|im_start|>assistant\n<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>\n")
        result = json.dumps({"result": rng.choice(words), "count": rng.randint(0, 99)})
        texts.append(f"<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n")
    return texts


def digest_inputs(texts: list[str], template: str, shape: dict[str, object]) -> str:
    h = hashlib.sha256()
    h.update(
        json.dumps({"v": BUILD_VERSION, "seed": SEED, "vocab": VOCAB_TARGET, "shape": shape}, sort_keys=True).encode()
    )
    h.update(Path(__file__).read_bytes())
    h.update(template.encode("utf-8"))
    for text in texts:
        h.update(hashlib.sha256(text.encode("utf-8", errors="replace")).digest())
    return h.hexdigest()


def build_tokenizer(texts: list[str]):  # -> tokenizers.Tokenizer
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # No normalizer: decode(encode(text)) == text for any text, which forced replies rely on.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET,
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return tok


def build(out: Path, preset: str = DEFAULT_PRESET, force: bool = False) -> dict:
    shape = PRESETS[preset]
    data_dir = shared_data_dir()
    texts = corpus_texts(data_dir)
    template, template_source = load_chat_template()
    digest = digest_inputs(texts, template, shape)
    info_path = out / "build_info.json"
    if not force and info_path.is_file():
        info = json.loads(info_path.read_text())
        if info.get("inputs_sha256") == digest:
            print(f"model up to date in {out} (inputs {digest[:12]})")
            return info

    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    t0 = time.monotonic()
    tok = build_tokenizer(texts)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=shape["max_position_embeddings"],
    )
    hf_tok.chat_template = template
    hf_tok.save_pretrained(tmp)
    t_tok = time.monotonic() - t0

    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS + ADDED_TOKENS}
    vocab_size = (tok.get_vocab_size(with_added_tokens=True) + 63) // 64 * 64

    t0 = time.monotonic()
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=vocab_size,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        torch_dtype="bfloat16",
        **shape,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp, safe_serialization=True)
    GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
    ).save_pretrained(tmp)
    t_model = time.monotonic() - t0

    info = {
        "inputs_sha256": digest,
        "build_version": BUILD_VERSION,
        "seed": SEED,
        "chat_template_source": template_source,
        "shared_data_dir": str(data_dir) if data_dir else None,
        "corpus_texts": len(texts),
        "tokenizer_vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "model_vocab_size": vocab_size,
        "token_ids": ids,
        "params": sum(p.numel() for p in model.parameters()),
        "preset": preset,
        "shape": shape,
        "seconds": {"tokenizer": round(t_tok, 1), "model": round(t_model, 1)},
    }
    (tmp / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(
        f"built model in {out}: {info['params'] / 1e6:.1f}M params, vocab {vocab_size}, "
        f"tokenizer {t_tok:.1f}s, model {t_model:.1f}s, template from {template_source}"
    )
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET)
    parser.add_argument("--out", type=Path, default=None, help="default: .work/model-PRESET")
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    build(args.out or model_dir(args.preset), args.preset, args.force)


if __name__ == "__main__":
    main()
