"""``prefix-proxy analyze`` output: per mode, per app, per cause and against the floor (a table, or JSON)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from proxy.analysis.floors import FLOOR_MEASURE, FloorResult, FloorTally
from proxy.analysis.replay import ModeResult, Tally
from proxy.observability import CAUSES

OVERALL = "overall"


def to_json(
    results: Sequence[ModeResult],
    captured: Tally,
    block_size: int,
    tokenizer: str,
    floors: FloorResult | None = None,
) -> dict[str, Any]:
    baseline = next((r.total for r in results if r.mode == "off"), None)
    modes = {}
    for result in results:
        row = result.total.to_json()
        if baseline is not None and baseline.prefill_tokens:
            row["prefill_saved_vs_off"] = round(1 - result.total.prefill_tokens / baseline.prefill_tokens, 4)
        row["skipped"] = result.skipped
        modes[result.mode] = row
    apps: dict[str, dict[str, Any]] = {}
    for result in results:
        for app, tally in sorted(result.apps.items()):
            apps.setdefault(app, {})[result.mode] = tally.to_json()
    causes = {
        result.mode: {
            cause: {"requests": result.cause_requests[cause], "tokens_lost": result.cause_tokens[cause]}
            for cause in CAUSES
            if result.cause_requests[cause]
        }
        for result in results
    }
    report: dict[str, Any] = {
        "modes": modes,
        "apps": apps,
        "causes": causes,
        "captured": captured.to_json(),
        "block_size": block_size,
        "tokenizer": tokenizer,
    }
    if floors is not None:
        report["floor"] = _floor_json(results, floors)
    return report


def _floor_json(results: Sequence[ModeResult], floors: FloorResult) -> dict[str, Any]:
    """The floor overall and per app, with each mode's prefill as a multiple of it (``x_floor``)."""

    def row(floor: FloorTally, prefill: dict[str, int]) -> dict[str, Any]:
        return {**floor.to_json(), "x_floor": {mode: floor.times(tokens) for mode, tokens in prefill.items()}}

    overall = row(floors.total, {r.mode: r.total.prefill_tokens for r in results})
    apps = {
        name: row(floor, {r.mode: r.apps[name].prefill_tokens for r in results if name in r.apps})
        for name, floor in sorted(floors.apps.items())
    }
    return {"measure": FLOOR_MEASURE, "skipped": floors.skipped, OVERALL: overall, "apps": apps}


def format_report(report: dict[str, Any]) -> str:
    modes: dict[str, Any] = report["modes"]
    names = list(modes)
    captured = report["captured"]
    lines = [
        f"Replay of {captured['requests']:,} captured requests ({report['tokenizer']}, "
        f"{report['block_size']}-token blocks); as served during the capture: hit rate "
        f"{captured['hit_rate']:.1%}, {captured['prefill_tokens']:,} prefill tokens",
        "",
        f"{'mode':<10} {'prompt':>12} {'cached':>12} {'hit':>7} {'prefill':>12} {'saved vs off':>13} {'x floor':>8}",
    ]
    floor: dict[str, Any] | None = report.get("floor")
    for mode, row in modes.items():
        saved = row.get("prefill_saved_vs_off")
        times = _times(floor[OVERALL]["x_floor"].get(mode)) if floor else "-"
        lines.append(
            f"{mode:<10} {row['prompt_tokens']:>12,} {row['cached_tokens']:>12,} {row['hit_rate']:>7.1%} "
            f"{row['prefill_tokens']:>12,} {'' if saved is None else f'{saved:.1%}':>13} {times:>8}"
        )
    if floor:
        lines += ["", *_floor_table(floor, names)]
    lines += ["", "Hit rate per app (tenant/model):", f"{'app':<36}" + "".join(f"{m:>10}" for m in names)]
    for app, per_mode in report["apps"].items():
        cells = "".join(f"{per_mode[m]['hit_rate']:>10.1%}" if m in per_mode else f"{'-':>10}" for m in names)
        lines.append(f"{app[:36]:<36}{cells}")
    lines += [
        "",
        "Where prefill goes: estimated tokens lost per cause (requests)",
        f"{'cause':<24}" + "".join(f"{m:>20}" for m in names),
    ]
    causes: dict[str, Any] = report["causes"]
    for cause in CAUSES:
        if not any(cause in causes[m] for m in names):
            continue
        cells = ""
        for mode in names:
            entry = causes[mode].get(cause)
            text = f"{entry['tokens_lost']:,} ({entry['requests']})" if entry else "-"
            cells += f"{text:>20}"
        lines.append(f"{cause:<24}{cells}")
    return "\n".join(lines)


def _floor_table(floor: dict[str, Any], names: list[str]) -> list[str]:
    overall = floor[OVERALL]
    lines = [
        f"Floor: {overall['floor_tokens']:,} tokens ({overall['new_lines']:,} lines, {overall['new_bytes']:,} bytes "
        "no earlier request of the same app carried; replies count as seen)",
        f"  {floor['measure']}",
        "Prefill per app as a multiple of its floor:",
        f"{'app':<36}{'floor':>10}" + "".join(f"{m:>10}" for m in names),
    ]
    for app, row in [*floor["apps"].items(), (OVERALL, overall)]:
        cells = "".join(f"{_times(row['x_floor'].get(m)):>10}" for m in names)
        lines.append(f"{app[:36]:<36}{row['floor_tokens']:>10,}{cells}")
    return lines


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
