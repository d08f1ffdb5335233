"""The bench's table (markdown), its JSON, and the block of docs/clients.md it regenerates."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[2] / "docs" / "clients.md"
BEGIN = "<!-- clients-table:begin -->"
END = "<!-- clients-table:end -->"

HEADER = (
    "| client | scenario | mode | exits | requests (client / backend) | errors | prompt tokens | cached "
    "| prefill | hit rate | text not sent by client | torn units |\n"
    "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def row(run: dict[str, Any]) -> str:
    name = f"| {run['client']} | {run['scenario']} | {'via proxy' if run['mode'] == 'proxy' else 'direct'} "
    if run.get("skipped"):
        return name + f"| skipped: {run['skipped']} | | | | | | | | |"
    exits = ",".join("T" if t["timed_out"] else str(t["exit_code"]) for t in run["turns"])
    return (
        name + f"| {exits} | {run['client_requests']} / {run['backend_requests']} | {run['errors']} "
        f"| {run['prompt_tokens']:,} | {run['cached_tokens']:,} | {run['prefill_tokens']:,} "
        f"| {run['hit_rate']:.1%} | {run['foreign_text_requests']} | {run.get('torn_units', '-')} |"
    )


def comparison(runs: Sequence[dict[str, Any]]) -> list[str]:
    """Per client and scenario: prefill through the proxy against direct."""
    lines = []
    keyed = {(r["client"], r["scenario"], r["mode"]): r for r in runs if not r.get("skipped")}
    for (client, scenario, mode), direct in keyed.items():
        proxied = keyed.get((client, scenario, "proxy"))
        if mode != "direct" or proxied is None or not direct["prefill_tokens"]:
            continue
        ratio = proxied["prefill_tokens"] / direct["prefill_tokens"]
        lines.append(
            f"- {client} ({scenario}): prefill {direct['prefill_tokens']:,} direct -> "
            f"{proxied['prefill_tokens']:,} via proxy ({ratio:.2f}x); hit rate {direct['hit_rate']:.1%} -> "
            f"{proxied['hit_rate']:.1%}"
        )
    return lines


def markdown(meta: dict[str, Any], runs: Sequence[dict[str, Any]], unavailable: dict[str, str]) -> str:
    lines = [
        f"`{meta['command']}` ({meta['engine']} backend, model `{meta['model']}`, {meta['turns']} turns, "
        f"{meta['date']}; client versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items())})",
        "",
        HEADER,
        *(row(r) for r in runs),
        "",
        *comparison(runs),
    ]
    for name, why in unavailable.items():
        lines.append(f"- {name}: not run: {why}")
    return "\n".join(lines).rstrip() + "\n"


def update_doc(table: str, doc: Path = DOC) -> bool:
    """Replace the block between the markers in docs/clients.md; False when the markers are missing."""
    if not doc.exists():
        return False
    text = doc.read_text()
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        return False
    doc.write_text(pattern.sub(lambda _: f"{BEGIN}\n{table}{END}", text))
    return True


def main() -> None:
    """``python -m bench.clients.report bench/results/clients-fake-DATE.json [--update-doc]``: the table again."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m bench.clients.report", description=main.__doc__)
    parser.add_argument("results", type=Path)
    parser.add_argument("--update-doc", action="store_true")
    args = parser.parse_args()
    data = json.loads(args.results.read_text())
    table = markdown(data["meta"], data["runs"], data.get("unavailable", {}))
    print(table)
    if args.update_doc and not update_doc(table):
        raise SystemExit("docs/clients.md has no table markers")


if __name__ == "__main__":
    main()
