"""What every framework driver of ``bench.clients`` (``PythonAgent``: one turn per process, with the
framework venv's interpreter) does the same way: its state file, its command line, and the
repository its tools and retrievers read (the run's working directory, a git repository).

Standard library only: the framework venvs hold nothing else of the project's.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

# A word a keyword retriever matches on.
WORD = re.compile(r"[a-z0-9_]{3,}")


def write_state(state_path: Path, openai_base: str, model: str) -> None:
    """Before the first turn: where the agent's model is, and no conversation yet."""
    if not state_path.exists():
        state_path.write_text(json.dumps({"base_url": openai_base, "model": model, "history": []}))


def main(argv: list[str], usage: str | None, one_turn: Callable[[Path, str], int]) -> int:
    """``turn STATE PROMPT``: one turn; anything else prints ``usage`` (the driver's docstring)."""
    if len(argv) != 3 or argv[0] != "turn":
        print(usage, file=sys.stderr)
        return 2
    return one_turn(Path(argv[1]), argv[2])


def git(*args: str) -> str:
    done = subprocess.run(["git", *args], capture_output=True, text=True, check=False)
    return done.stdout


def read_file(path: str) -> str:
    """A repository file's text, or the error a careful tool reports for a made-up path."""
    try:
        return (Path.cwd() / path).read_text()
    except OSError as exc:
        return f"error: {exc.strerror}: {path}"


def ranked_files(question: str, k: int) -> list[tuple[int, str, str]]:
    """The ``k`` files of the repository (tracked and untracked) sharing most words with the
    question, as ``(score, path, text)``: always ``k`` where there are that many, ties by path, as
    a vector store returns its top ``k``."""
    paths = sorted(set(git("ls-files").split()) | set(git("ls-files", "--others", "--exclude-standard").split()))
    asked = set(WORD.findall(question.lower()))
    scored = []
    for path in paths:
        text = (Path.cwd() / path).read_text(errors="replace")
        scored.append((-len(asked & set(WORD.findall((path + " " + text).lower()))), path, text))
    scored.sort(key=lambda item: item[:2])
    return [(-negative, path, text) for negative, path, text in scored[:k]]
