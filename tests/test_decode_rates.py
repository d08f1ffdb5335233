"""The summary deadline follows the decoding rate the engine's answers were measured at."""

from __future__ import annotations

from proxy.chat.decoding import SLACK, DecodeRates


def test_a_slow_engine_gets_the_time_its_decoding_needs_and_a_fast_one_the_configured_floor() -> None:
    rates = DecodeRates()
    assert rates.deadline("m", 512, 60.0) == 60.0, "nothing measured: the configured timeout"
    rates.observe("m", 96, 1.0)  # 96 tokens/s: 512 tokens well within 60 s
    assert rates.deadline("m", 512, 60.0) == 60.0
    rates.observe("m", 96, 24.0)  # a CPU engine at 4 tokens/s, busy
    assert rates.rate("m") == 4.0
    assert rates.deadline("m", 512, 60.0) == SLACK * 512 / 4.0
    assert rates.deadline("other", 512, 60.0) == 60.0, "per model"


def test_answers_too_short_to_say_how_fast_the_engine_decodes_are_not_measured() -> None:
    rates = DecodeRates()
    rates.observe("m", 1, 5.0)  # one token after a long prefill
    rates.observe("m", 50, 0.0)
    rates.observe(None, 50, 1.0)
    assert rates.rate("m") is None
