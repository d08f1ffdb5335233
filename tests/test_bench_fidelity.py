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
