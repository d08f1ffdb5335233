"""tiktoken must work with no network: the encoding ships in the package, hash-verified."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest

from proxy.tokenization import TokenCounter, load_encoding
from proxy.tokenization import encoding as encoding_module


def test_encoding_loads_in_a_process_without_network(tmp_path) -> None:
    script = textwrap.dedent(
        """
        import socket
        def refuse(*args, **kwargs):
            raise OSError("network disabled in this test")
        socket.socket.connect = refuse
        socket.create_connection = refuse
        from proxy.tokenization import load_encoding
        print(load_encoding().encode("hello world"))
        """
    )
    env = {"TIKTOKEN_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[15339, 1917]"
    assert list(tmp_path.iterdir()) == [], "nothing was fetched into tiktoken's cache"


def test_matches_tiktoken_reference_ids() -> None:
    # Reference ids of cl100k_base, as published by OpenAI's tokenizer.
    assert load_encoding().encode("tiktoken is great!") == [83, 1609, 5963, 374, 2294, 0]
    assert load_encoding().n_vocab == 100277


def test_corrupt_bundle_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(encoding_module, "CL100K_SHA256", "0" * 64)
    load_encoding.cache_clear()
    try:
        with pytest.raises(encoding_module.EncodingIntegrityError):
            load_encoding()
    finally:
        monkeypatch.undo()
        load_encoding.cache_clear()


def test_counter_memoizes_by_hash() -> None:
    counter = TokenCounter(max_entries=2)
    text = "a long message " * 100
    assert counter.count_text(text) == counter.count_text(text) == len(load_encoding().encode_ordinary(text))
    assert counter.count_message({"role": "user", "content": [{"type": "text", "text": "hi"}]}) > 0
    socket.socket  # noqa: B018 - the module stays importable and untouched here


def test_the_encoding_is_loaded_by_the_first_count_not_before() -> None:
    # ~35 MiB that a proxy whose requests never come near a limit does not spend.
    load_encoding.cache_clear()
    counter = TokenCounter()
    assert load_encoding.cache_info().currsize == 0
    assert counter.count_text("hello world") == 2
    assert load_encoding.cache_info().currsize == 1
