"""Promise (issue 39): megalite/ holds only what a run or a tool executes. Test apparatus (published rows,
calibrations, fixtures) lives under tests/, so that a module under megalite/ is never one that only the
tests import.

Every import statement of the code that runs megalite (pretrain_gpt.py, tools/, tasks/, bench/, scripts/)
is read from the source (module level and function level, so a lazy import counts) and followed through
the package's own imports; every module under megalite/ must be reached. The tests' imports are not
followed: a module they alone reach belongs with them.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "megalite"
ENTRY_POINTS = ["pretrain_gpt.py", "tools", "tasks", "bench", "scripts"]  # what runs megalite, tests apart


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {_name(p): p for p in PKG.rglob("*.py")}


def _imported(path: Path, known: dict[str, Path]) -> set[str]:
    """The megalite modules an import statement of ``path`` loads: the named module, the packages above it,
    for ``from package import name`` the submodule ``name`` where there is one, and a submodule reached as
    an attribute of an imported package (``families.gpt2`` after ``from ...hf import families``)."""
    me = _name(path) if path.is_relative_to(PKG) else ""
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    named: list[str] = []
    bound: dict[str, str] = {}  # a local name -> the module it was imported as
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named += [a.name for a in node.names]
            bound.update({a.asname: a.name for a in node.names if a.asname})
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            named += [base, *(f"{base}.{a.name}" for a in node.names)]
            bound.update({a.asname or a.name: f"{base}.{a.name}" for a in node.names})
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            named.append(f"{bound[node.value.id]}.{node.attr}")
    out = set()
    for module in named:
        parts = module.split(".")
        out |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & known.keys()
    return out


def entry_files() -> list[Path]:
    files: list[Path] = []
    for entry in ENTRY_POINTS:
        path = ROOT / entry
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return files


def reached(files: list[Path], known: dict[str, Path]) -> set[str]:
    """The megalite modules ``files`` load, directly or through the package's own imports."""
    todo = set().union(*(_imported(f, known) for f in files))
    seen: set[str] = set()
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo |= _imported(known[module], known) - seen
    return seen


def test_every_package_module_is_run_by_an_entry_point():
    known = package_modules()
    unreached = sorted(set(known) - reached(entry_files(), known))
    assert not unreached, (f"modules under megalite/ that no entry point ({', '.join(ENTRY_POINTS)}) loads, only "
                           f"the tests (move them under tests/): {unreached}")


def test_the_scan_sees_a_module_only_the_tests_import(tmp_path):
    """The check can fail: a module the package's own files do not import is reported even though a test
    imports it; one imported lazily inside a function, or reached as an attribute of its package, is not."""
    pkg = tmp_path / "megalite"
    (pkg / "planning").mkdir(parents=True)
    for name, text in {"__init__.py": "", "planning/__init__.py": "",
                       "planning/cli.py": "def main():\n    from megalite.planning import estimate\n",
                       "planning/estimate.py": "from .cli import main\nfrom megalite import planning as p\np.kinds.X\n",
                       "planning/kinds.py": "X = 1\n", "planning/rows.py": "ROWS = []\n"}.items():
        (pkg / name).write_text(text)
    entry = tmp_path / "plan.py"
    entry.write_text("from megalite.planning.cli import main\n")
    test = tmp_path / "test_rows.py"
    test.write_text("from megalite.planning.rows import ROWS\n")
    global ROOT, PKG
    saved = ROOT, PKG
    ROOT, PKG = tmp_path, pkg
    try:
        known = package_modules()
        assert set(known) - reached([entry], known) == {"megalite.planning.rows"}
        assert "megalite.planning.rows" in reached([test], known)
    finally:
        ROOT, PKG = saved
