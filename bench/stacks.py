"""Collapsed stacks (``py-spy record --format raw``, or any folded-stack file): top entries and a flame graph.

    python -m bench.stacks PROFILE.txt [--top 15] [--svg PROFILE.svg]

Each line of the input is ``frame;frame;...;frame COUNT``, outermost frame first. The top entries
are given by own samples (the frame was the innermost one) and by total samples (the frame was
anywhere on the stack, counted once per sample; frames as frequent as the most frequent one, the
process's entry point and event loop, are left out), as shares of all samples. The SVG is a static
flame graph (frames sorted by name at each level, widths proportional to samples, a tooltip per
frame with its samples and share).
"""

from __future__ import annotations

import argparse
import hashlib
from collections import Counter
from dataclasses import dataclass, field
from html import escape
from pathlib import Path


def read(path: Path) -> Counter[tuple[str, ...]]:
    stacks: Counter[tuple[str, ...]] = Counter()
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        frames, _, count = line.rstrip().rpartition(" ")
        if frames and count.isdigit():
            stacks[tuple(frames.split(";"))] += int(count)
    return stacks


def top(stacks: Counter[tuple[str, ...]], n: int = 15) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """The ``n`` frames with most own samples and with most total samples, as shares of all samples."""
    total = sum(stacks.values()) or 1
    own: Counter[str] = Counter()
    anywhere: Counter[str] = Counter()
    for frames, count in stacks.items():
        own[frames[-1]] += count
        for frame in set(frames):
            anywhere[frame] += count
    base = max(anywhere.values(), default=0)
    below_all = [(frame, count) for frame, count in anywhere.most_common() if count < base]
    return (
        [(frame, count / total) for frame, count in own.most_common(n)],
        [(frame, count / total) for frame, count in below_all[:n]],
    )


def markdown(stacks: Counter[tuple[str, ...]], n: int = 15) -> str:
    own, anywhere = top(stacks, n)
    lines = [f"{sum(stacks.values())} samples", "", "| own | frame | | total | frame |", "|---:|---|---|---:|---|"]
    for (a, a_share), (b, b_share) in zip(own, anywhere, strict=False):
        lines.append(f"| {a_share:.1%} | `{a}` | | {b_share:.1%} | `{b}` |")
    return "\n".join(lines)


@dataclass
class Node:
    count: int = 0
    children: dict[str, Node] = field(default_factory=dict)


def tree(stacks: Counter[tuple[str, ...]]) -> Node:
    root = Node()
    for frames, count in stacks.items():
        root.count += count
        node = root
        for frame in frames:
            node = node.children.setdefault(frame, Node())
            node.count += count
    return root


def svg(stacks: Counter[tuple[str, ...]], title: str, width: int = 1200, row: int = 16) -> str:
    """A flame graph: the root at the bottom, callees above their callers."""
    root = tree(stacks)
    total = root.count or 1

    def depth(node: Node) -> int:
        return 1 + max((depth(child) for child in node.children.values()), default=0)

    height = (depth(root) + 2) * row
    scale = (width - 20) / total
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace" '
        f'font-size="11"><rect width="100%" height="100%" fill="#f8f8f8"/>',
        f'<text x="10" y="{row - 4}" font-size="13">{escape(title)} ({total} samples)</text>',
    ]

    def draw(name: str, node: Node, x: float, level: int) -> None:
        w = node.count * scale
        if w < 0.3:
            return
        y = height - (level + 1) * row
        digest = hashlib.blake2b(name.encode(), digest_size=2).digest()
        color = f"rgb({205 + digest[0] % 50},{80 + digest[1] % 130},{40 + digest[0] % 50})"
        tip = escape(f"{name} ({node.count} samples, {node.count / total:.1%})")
        out.append(
            f'<g><title>{tip}</title><rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 1}" fill="{color}"/>'
        )
        chars = int(w / 6.6)
        if chars >= 3:
            label = name if len(name) <= chars else name[: chars - 2] + ".."
            out.append(f'<text x="{x + 2:.1f}" y="{y + row - 4}">{escape(label)}</text>')
        out.append("</g>")
        child_x = x
        for child_name in sorted(node.children):
            child = node.children[child_name]
            draw(child_name, child, child_x, level + 1)
            child_x += child.count * scale

    x = 10.0
    for name in sorted(root.children):
        draw(name, root.children[name], x, 0)
        x += root.children[name].count * scale
    out.append("</svg>")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path, help="collapsed stacks (py-spy record --format raw)")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--svg", type=Path, help="write a flame graph here")
    args = parser.parse_args()
    stacks = read(args.profile)
    print(markdown(stacks, args.top))
    if args.svg:
        args.svg.write_text(svg(stacks, args.profile.stem), encoding="utf-8")


if __name__ == "__main__":
    main()
