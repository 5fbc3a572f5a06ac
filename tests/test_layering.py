"""Promise (docs/design.md §1): inside megalite/, no import runs from a lower layer to a higher one.

Every import statement is read from the source (module level, function level, under TYPE_CHECKING),
so a lazy import cannot hide an upward dependency. LAYERS is the one table of the layering; the
documentation's "Layers, bottom to top" line must list the same order.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "megalite"

# Bottom to top; a module may import modules of its own layer and below.
LAYERS = ["compat", "device", "parallel", "config", "planning", "data", "tensor_parallel", "context_parallel", "moe",
          "pipeline", "model", "distributed", "optimizer", "checkpointing", "inference", "training"]
# Modules that live in one package but belong to another layer (longest prefix wins).
PLACED = {
    "megalite": "device",  # the package itself: __version__ only
    "megalite.data.config": "config",  # DataConfig: a config dataclass kept beside its package
    "megalite.training.flops": "config",  # the FLOPs formula: arithmetic on ModelConfig (the planner uses it)
}
# Upward imports still to be removed, as (importing module, imported module), each with the change
# that removes it. Remove the entry with the import; the test fails on an entry that no longer matches.
ALLOWED: set[tuple[str, str]] = set()


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int | None:
    """Index in LAYERS of a megalite module (None for anything outside megalite)."""
    parts = module.split(".")
    if parts[0] != "megalite":
        return None
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in PLACED:
            return LAYERS.index(PLACED[prefix])
        if n == 2 and parts[1] in LAYERS:
            return LAYERS.index(parts[1])
    raise AssertionError(f"{module} belongs to no layer: add its package to LAYERS or the module to PLACED")


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, imported module) of every import in the file; ``from megalite import device`` names
    ``megalite.device``."""
    out = []
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                is_module = (root / (sub.replace(".", "/") + ".py")).exists() or (root / sub.replace(".", "/")).is_dir()
                out.append((node.lineno, sub if is_module else base))
    return out


def upward_imports(root: Path = ROOT) -> list[tuple[str, int, str, str]]:
    """(file, line, importer, imported) of every import under root/megalite that points to a higher layer."""
    found = []
    for path in sorted((root / "megalite").rglob("*.py")):
        me = module_name(path, root)
        mine = layer_of(me)
        for line, target in imports(path, root):
            theirs = layer_of(target)
            if theirs is not None and theirs > mine:
                found.append((str(path.relative_to(root)), line, me, target))
    return found


def test_no_import_runs_upward():
    found = upward_imports()
    bad = [f"{f}:{line}: {me} ({LAYERS[layer_of(me)]}) imports {t} ({LAYERS[layer_of(t)]})"
           for f, line, me, t in found if (me, t) not in ALLOWED]
    assert not bad, "imports from a lower layer to a higher one (docs/design.md §1):\n  " + "\n  ".join(bad)


def test_allow_list_entries_still_match():
    seen = {(me, t) for _, _, me, t in upward_imports()}
    stale = sorted(ALLOWED - seen)
    assert not stale, f"ALLOWED entries that no longer occur (remove them): {stale}"


def test_every_package_has_a_layer():
    packages = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in PKG.glob("*.py") if p.stem != "__init__"}
    assert packages | modules <= set(LAYERS), f"not in LAYERS: {sorted((packages | modules) - set(LAYERS))}"


def test_design_doc_states_the_same_layers():
    text = (ROOT / "docs" / "design.md").read_text()
    m = re.search(r"Layers, bottom to top: ([^.]+)\.", text)
    assert m, "docs/design.md has no 'Layers, bottom to top: ...' line"
    assert [w.strip() for w in m[1].replace("\n", " ").split(",")] == LAYERS


def test_an_upward_import_is_found(tmp_path):
    """The check can fail: a function-level import of training from model is reported with its line."""
    for pkg in ("model", "training"):
        (tmp_path / "megalite" / pkg).mkdir(parents=True)
    (tmp_path / "megalite" / "training" / "loop.py").write_text("")
    (tmp_path / "megalite" / "model" / "bad.py").write_text("def f():\n    from megalite.training import loop\n")
    assert upward_imports(tmp_path) == [("megalite/model/bad.py", 2, "megalite.model.bad", "megalite.training.loop")]
