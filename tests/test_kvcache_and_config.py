"""The KV-cache calculator and the configuration precedence (flags > env > file > defaults)."""

from __future__ import annotations

import json

import pytest

from proxy.capacity.kvcache import PRESETS, resolve_shape, shape_from_hf_config
from proxy.cli import main
from proxy.config import load_settings
from proxy.config_sources import ConfigError


def test_kv_cli_prints_16_gib_for_llama_8b(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kv", "--model", "llama-3.1-8b", "--context", "131072"]) == 0
    out = capsys.readouterr().out
    assert "per token: 128 KiB" in out
    assert "131072 tokens: 16 GiB" in out


@pytest.mark.parametrize(
    ("model", "dtype", "per_token"),
    [
        ("llama-3.1-70b", "fp16", 320 * 1024),
        ("llama-3.1-70b", "fp8", 160 * 1024),
        ("qwen2.5-7b", "bf16", 56 * 1024),
        ("qwen2.5-72b", "int8", 160 * 1024),
    ],
)
def test_presets(model: str, dtype: str, per_token: int) -> None:
    assert PRESETS[model].bytes_per_token(dtype) == per_token


def test_hf_config_and_mla(tmp_path) -> None:
    gqa = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    assert shape_from_hf_config(gqa).bytes_per_token("fp16") == 128 * 1024
    mla = {"num_hidden_layers": 61, "num_attention_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    assert shape_from_hf_config(mla).bytes_per_token("bf16") == 61 * 576 * 2
    path = tmp_path / "config.json"
    path.write_text(json.dumps(gqa))
    assert resolve_shape(None, str(path)).layers == 32
    with pytest.raises(ValueError, match="unknown model"):
        resolve_shape("gpt-17", None)
    with pytest.raises(ValueError, match="unknown KV dtype"):
        PRESETS["llama-3.1-8b"].bytes_per_token("fp4")


def test_config_precedence(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "proxy.yaml"
    config.write_text("upstream: http://file:1/v1\nport: 7000\nhost: 0.0.0.0\ncanon:\n  mode: safe\n")
    monkeypatch.setenv("PREFIX_PROXY_PORT", "7100")
    monkeypatch.setenv("PREFIX_PROXY_CANON__RELOCATE_TARGET", "system_end")
    settings = load_settings(str(config), upstream="http://flag:2/v1", host=None, port=None)
    assert settings.upstream == "http://flag:2/v1"  # flag
    assert settings.port == 7100  # env over file
    assert settings.host == "0.0.0.0"  # file over default
    assert settings.canon.mode == "safe" and settings.canon.relocate_target == "system_end"
    assert settings.sessions.store == "memory"  # default
    toml = tmp_path / "proxy.toml"
    toml.write_text('upstream = "http://toml:3/v1"\n[sessions]\nstore = "redis"\n')
    monkeypatch.delenv("PREFIX_PROXY_PORT")
    settings = load_settings(str(toml))
    assert settings.upstream == "http://toml:3/v1" and settings.sessions.store == "redis"


def test_detector_names_are_the_canonicalizers_and_checked_when_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    from proxy.canon.volatile import BUILTIN_DETECTORS
    from proxy.config import Settings

    assert Settings().canon.builtin_detectors == list(BUILTIN_DETECTORS), "every built-in detector is on by default"
    monkeypatch.setenv("PREFIX_PROXY_CANON__BUILTIN_DETECTORS", '["datetime", "timestamp"]')
    with pytest.raises(ConfigError, match="builtin_detectors"):
        load_settings()
