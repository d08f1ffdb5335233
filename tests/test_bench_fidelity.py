"""bench.fidelity's scoring (pure): the run itself needs llama-server and the model (bench/)."""

from __future__ import annotations

from bench.fidelity import FAMILIES, probes, score


def test_every_family_asks_what_only_its_moved_text_answers() -> None:
    asked = probes(3, list(FAMILIES))
    assert len(asked) == 3 * len(FAMILIES)
    for probe in asked:
        system = probe.body["messages"][0]["content"]
        tools = " ".join(tool["function"]["name"] for tool in probe.body.get("tools", []))
        assert probe.expected in system or probe.expected in tools, probe
        assert probe.expected not in probe.body["messages"][-1]["content"]
        assert probe.body["temperature"] == 0


def test_an_answer_right_directly_and_wrong_through_the_proxy_is_counted_and_shown() -> None:
    asked = probes(2, ["retrieved_fact"])
    codes = [probe.expected for probe in asked]
    direct = [f"The code is {codes[0]}.", "I do not know."]
    proxied = ["I do not know.", f"It is {codes[1]}."]
    row = score(asked, direct, proxied, [True, True])["retrieved_fact"]
    assert (row.right_direct, row.right_proxy, row.right_to_wrong, row.wrong_to_right) == (1, 1, 1, 1)
    assert row.identical == 0 and row.rewritten == 2 and row.rewritten_answered_from_moved_text == 1
    assert codes[0] in row.lost[0]


def test_a_weekday_answer_is_the_first_weekday_it_names() -> None:
    """ "Today is Wednesday, which is a Monday" answers Wednesday: a substring match called it right
    for a Monday, and counted the model's noise as answers the proxy lost."""
    (probe,) = probes(1, ["date_line"])
    other = next(day for day in ("Monday", "Wednesday") if day != probe.expected)
    assert probe.answered_by(f"Today is {probe.expected}.")
    assert probe.answered_by(f"Today is {probe.expected}, not {other}.")
    assert not probe.answered_by(f"Today is {other}, which is a {probe.expected} in the 24-hour calendar.")
    assert not probe.answered_by("I cannot tell.")
