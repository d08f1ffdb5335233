"""Each package of the product has one way in: its ``__init__`` (its face).

Code outside a package imports what the package offers from the package itself
(``from proxy.canon import canonicalize``), never from the module that happens to define it
(``from proxy.canon.engine import canonicalize``); inside a package, modules import their siblings
directly. So a package can move things between its modules without its users noticing, and its
``__all__`` is the list of what it offers. Tests may reach inside a package (they test modules);
the product, the fake backend (``testbed``) and the benchmarks may not.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("proxy", "summarizer", "testbed", "bench")


def _module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def _package_of(module: str) -> str | None:
    """The face a module belongs behind: ``summarizer``, or ``proxy.<package>``; None for a
    top-level module of ``proxy`` (``proxy.config``), which is its own face."""
    parts = module.split(".")
    if parts[0] == "summarizer":
        return "summarizer"
    if parts[0] == "proxy" and len(parts) >= 2 and (ROOT / "proxy" / parts[1] / "__init__.py").exists():
        return f"proxy.{parts[1]}"
    return None


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _faces() -> list[str]:
    return sorted({"summarizer"} | {f"proxy.{p.parent.name}" for p in (ROOT / "proxy").glob("*/__init__.py")})


def _sources() -> list[Path]:
    """The project's Python files (what git tracks: not an installed venv under bench/)."""
    listed = subprocess.run(
        ["git", "ls-files", "--", *(f"{top}/*.py" for top in SOURCES)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [ROOT / name for name in listed]


def _imports_behind_faces() -> list[str]:
    found = []
    for path in _sources():
        importer = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            face = _package_of(node.module)
            if face is None or node.module == face or importer == face or importer.startswith(face + "."):
                continue
            for alias in node.names:
                if not _is_module(f"{node.module}.{alias.name}"):
                    where = f"{path.relative_to(ROOT)}:{node.lineno}"
                    found.append(f"{where}: from {node.module} import {alias.name} (use: from {face} import ...)")
    return found


def test_imports_between_packages_go_through_the_face() -> None:
    assert _imports_behind_faces() == []


@pytest.mark.parametrize("face", _faces())
def test_every_face_says_what_it_offers(face: str) -> None:
    module = importlib.import_module(face)
    assert module.__doc__, f"{face}: a face starts with a docstring saying what the package is for"
    offered = getattr(module, "__all__", None)
    if offered is None:
        # A package whose modules are used by name (proxy.routes: one module per route family)
        # offers nothing but its modules.
        assert not [n for n in vars(module) if not n.startswith("_") and not _is_module(f"{face}.{n}")]
        return
    missing = [name for name in offered if not hasattr(module, name)]
    assert missing == [], f"{face}.__all__ names what it does not define"
