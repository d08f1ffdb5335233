"""Built-in volatile-span detectors, on real strings, and what they must leave alone."""

from __future__ import annotations

import pytest

from proxy.canon.volatile import (
    detect_context_blocks,
    detect_datetimes,
    detect_request_ids,
    detect_uuids,
    detect_weekdays,
    marker_detector,
    regex_detector,
)


def found(detector, text: str) -> list[str]:
    return [text[s.start : s.end] for s in detector(text)]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Current time: 2026-11-29T14:03:11Z", "2026-11-29T14:03:11Z"),
        ("now=2026-11-29T14:03:11.123+08:00", "2026-11-29T14:03:11.123+08:00"),
        ("Date: 2026-11-29", "2026-11-29"),
        ("Date: Sun, 29 Nov 2026 14:03:11 +0000", "Sun, 29 Nov 2026 14:03:11 +0000"),
        ("当前时间：2026年11月29日 14:03", "2026年11月29日 14:03"),
        ("今天是2026年11月29日", "2026年11月29日"),
        ("Current time: Sunday, 02:03:11 PM", "02:03:11 PM"),
        ("Today is November 29, 2026", "November 29, 2026"),
        ("timestamp 1764424991", "1764424991"),
    ],
)
def test_datetime_detector_finds_stamps(text: str, expected: str) -> None:
    assert expected in found(detect_datetimes, text)


@pytest.mark.parametrize(
    "text",
    [
        # A date that is part of an instruction's meaning stays (no clock, long sentence around it).
        "Only cite regulations that were passed after 2021-01-01 when you answer questions about tax policy.",
        "遵守2021年1月1日起施行的《民法典》中关于合同的全部规定，并在回答中引用相应的条款编号和原文。",
        "Version 3.12 of the tool is required.",
        "Use at most 10 items.",
    ],
)
def test_datetime_detector_leaves_instruction_dates(text: str) -> None:
    assert found(detect_datetimes, text) == []


def test_weekday_on_metadata_line_only() -> None:
    assert found(detect_weekdays, "Today is Sunday") == ["Sunday"]
    assert found(detect_weekdays, "今天星期日") == ["星期日"]
    sentence = "Remind the user that the office is closed on Sunday and that support replies within two days."
    assert found(detect_weekdays, sentence) == []


def test_uuid4_detected() -> None:
    text = "conversation_id: 550e8400-e29b-41d4-a716-446655440000"
    assert found(detect_uuids, text) == ["550e8400-e29b-41d4-a716-446655440000"]


def test_request_ids_need_digits_and_letters() -> None:
    assert found(detect_request_ids, "trace 4bf92f3577b34da6a3ce929d0e0e4736") == ["4bf92f3577b34da6a3ce929d0e0e4736"]
    assert found(detect_request_ids, "request req_8Hk2mQ9xZ1 done") == ["req_8Hk2mQ9xZ1"]
    assert found(detect_request_ids, "deadbeefdeadbeefdeadbeef") == []  # no digit: likely a word-ish token
    assert found(detect_request_ids, "1234567890123456789") == []


def test_dify_context_block() -> None:
    text = "<context>\nchunk one\nchunk two\n</context>\nAnswer with the context."
    assert found(detect_context_blocks, text) == ["<context>\nchunk one\nchunk two\n</context>"]


def test_user_rules() -> None:
    rule = regex_detector("ticket", r"TICKET-\d+")
    assert found(rule, "Handle TICKET-4411 now") == ["TICKET-4411"]
    markers = marker_detector("dyn", "[[dyn]]", "[[/dyn]]")
    assert found(markers, "a [[dyn]]x[[/dyn]] b [[dyn]]y[[/dyn]]") == ["[[dyn]]x[[/dyn]]", "[[dyn]]y[[/dyn]]"]
