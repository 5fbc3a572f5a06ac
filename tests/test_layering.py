"""Promise (docs/design.md §1): inside megalite/, no import runs from a lower layer to a higher one, and no
two modules import each other (directly or round a longer circle).

Every import statement is read from the source (module level, function level, under TYPE_CHECKING),
so a lazy import cannot hide an upward dependency or a circle. LAYERS is the one table of the layering;
the documentation's "Layers, bottom to top" line must list the same order. Every module sits in the
package of its layer: there is no table relabelling a module as another layer's. The scripts around the
package are layered too (TOP): megalite imports none of them, the entry points (pretrain_gpt.py, tools/,
tasks/) import megalite only, and the tests and benchmarks (which share a harness and formulas) sit above.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "megalite"

# Bottom to top; a module may import modules of its own layer and below. The package's own
# megalite/__init__.py (its version) sits below all of them.
LAYERS = ["compat", "device", "parallel", "config", "launch", "data", "tensor_parallel", "attention",
          "context_parallel", "moe", "pipeline", "planning", "model", "distributed", "optimizer", "checkpointing",
          "inference", "training"]
# Upward imports still to be removed, as (importing module, imported module), each with the change
# that removes it. Remove the entry with the import; the test fails on an entry that no longer matches.
ALLOWED: set[tuple[str, str]] = set()
# The code around the package, bottom to top: what each may import besides itself and the layers below.
TOP = {"megalite": set(), "pretrain_gpt": {"megalite"}, "tools": {"megalite"}, "tasks": {"megalite"},
       "tests": {"megalite", "pretrain_gpt", "tools", "tasks"},  # the formulas and counters bench shares live here
       "bench": {"megalite", "pretrain_gpt", "tools", "tasks", "tests"}}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int | None:
    """Index in LAYERS of a megalite module (-1 for the package itself, None for anything outside megalite)."""
    parts = module.split(".")
    if parts[0] != "megalite":
        return None
    if len(parts) == 1:
        return -1
    if parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    raise AssertionError(f"{module} belongs to no layer: add its package to LAYERS")


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


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """megalite module -> the megalite modules it imports (every import statement, lazy ones included)."""
    graph = {}
    for path in sorted((root / "megalite").rglob("*.py")):
        graph[module_name(path, root)] = {t for _, t in imports(path, root) if t.split(".")[0] == "megalite"}
    return {m: {t for t in ts if t in graph and t != m} for m, ts in graph.items()}


def import_circles(root: Path = ROOT) -> list[list[str]]:
    """Every set of megalite modules that import each other round a circle (strongly connected, size > 1)."""
    graph, index, low, stack, on, circles = import_graph(root), {}, {}, [], set(), []

    def visit(m: str) -> None:  # Tarjan's algorithm
        index[m] = low[m] = len(index)
        stack.append(m)
        on.add(m)
        for t in sorted(graph[m]):
            if t not in index:
                visit(t)
                low[m] = min(low[m], low[t])
            elif t in on:
                low[m] = min(low[m], index[t])
        if low[m] == index[m]:
            members = []
            while not members or members[-1] != m:
                members.append(stack.pop())
                on.discard(members[-1])
            if len(members) > 1:
                circles.append(sorted(members))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return circles


def test_no_import_circle():
    circles = import_circles()
    assert not circles, "modules that import each other (lazy imports count):\n  " + "\n  ".join(
        " <-> ".join(c) for c in circles)


def test_an_import_circle_is_found(tmp_path):
    """The check can fail: a TYPE_CHECKING import closing a circle of three modules is reported."""
    (tmp_path / "megalite" / "config").mkdir(parents=True)
    (tmp_path / "megalite" / "config" / "a.py").write_text("from megalite.config import b\n")
    (tmp_path / "megalite" / "config" / "b.py").write_text("import megalite.config.c\n")
    (tmp_path / "megalite" / "config" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megalite.config.a import X\n")
    assert import_circles(tmp_path) == [["megalite.config.a", "megalite.config.b", "megalite.config.c"]]


def top_of(path: Path, name: str, root: Path = ROOT) -> str | None:
    """The TOP part an imported name belongs to (a bare name of a sibling script is the importer's part)."""
    first = name.split(".")[0]
    if first in TOP:
        return first
    if (path.parent / f"{first}.py").exists() and path.parent != root:
        return path.relative_to(root).parts[0]
    return None


def top_level_violations(root: Path = ROOT) -> list[str]:
    """Imports between the package and the code around it that run against TOP's order."""
    found = []
    files = [root / "pretrain_gpt.py"]
    files += [p for d in TOP if d != "pretrain_gpt" for p in sorted((root / d).rglob("*.py"))]
    for path in files:
        if not path.exists():
            continue
        mine = path.relative_to(root).parts[0].removesuffix(".py")
        for line, name in imports(path, root):
            theirs = top_of(path, name, root)
            if theirs is not None and theirs != mine and theirs not in TOP[mine]:
                found.append(f"{path.relative_to(root)}:{line}: {mine} imports {name} ({theirs})")
    return sorted(set(found))


def test_the_code_around_the_package_is_layered():
    bad = top_level_violations()
    assert not bad, "imports against the order megalite < entry points < tests < bench:\n  " + "\n  ".join(bad)


def test_a_package_importing_a_tool_is_found(tmp_path):
    (tmp_path / "megalite" / "training").mkdir(parents=True)
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "plan.py").write_text("")
    (tmp_path / "megalite" / "training" / "x.py").write_text("def f():\n    from tools.plan import main\n")
    assert top_level_violations(tmp_path) == ["megalite/training/x.py:2: megalite imports tools.plan (tools)"]


def test_an_upward_import_is_found(tmp_path):
    """The check can fail: a function-level import of training from model is reported with its line."""
    for pkg in ("model", "training"):
        (tmp_path / "megalite" / pkg).mkdir(parents=True)
    (tmp_path / "megalite" / "training" / "loop.py").write_text("")
    (tmp_path / "megalite" / "model" / "bad.py").write_text("def f():\n    from megalite.training import loop\n")
    assert upward_imports(tmp_path) == [("megalite/model/bad.py", 2, "megalite.model.bad", "megalite.training.loop")]


# Inside checkpointing/ (docs/checkpoints.md, "Rooms"): the native format at its top level, one room per
# foreign format. The native format imports no room; a room imports the native format and itself, never
# another room; Megatron-LM's two formats (torch_dist/, legacy/) never import each other and share only what
# lies at megatron/'s own level (whose read.py opens either one).
CHECKPOINTING = "megalite.checkpointing"
ROOM_MAY_IMPORT = {
    "native": {"native"},
    "hf": {"native", "hf"},
    "megatron": {"native", "megatron", "megatron.torch_dist", "megatron.legacy"},
    "megatron.torch_dist": {"native", "megatron", "megatron.torch_dist"},
    "megatron.legacy": {"native", "megatron", "megatron.legacy"},
}


def room_of(module: str) -> str | None:
    """The checkpoint room a module lies in (None: outside megalite/checkpointing)."""
    parts = module.split(".")
    if parts[:2] != CHECKPOINTING.split("."):
        return None
    if len(parts) == 2 or parts[2] not in ("hf", "megatron"):
        return "native"
    if parts[2] == "megatron" and len(parts) > 3 and f"megatron.{parts[3]}" in ROOM_MAY_IMPORT:
        return f"megatron.{parts[3]}"
    return parts[2]


def room_violations(root: Path = ROOT) -> list[str]:
    """Imports inside checkpointing/ that cross from one room into a room ROOM_MAY_IMPORT does not allow."""
    found = []
    for path in sorted((root / "megalite" / "checkpointing").rglob("*.py")):
        mine = room_of(module_name(path, root))
        for line, target in imports(path, root):
            theirs = room_of(target)
            if theirs is not None and theirs not in ROOM_MAY_IMPORT[mine]:
                found.append(f"{path.relative_to(root)}:{line}: {mine} imports {target} ({theirs})")
    return list(dict.fromkeys(found))  # one line per import statement, however many names it takes


def test_checkpoint_rooms_do_not_import_each_other():
    bad = room_violations()
    assert not bad, "imports between checkpoint rooms (docs/checkpoints.md, Rooms):\n  " + "\n  ".join(bad)


def test_a_planted_import_between_rooms_is_found(tmp_path):
    """The check can fail: the native format importing a room, one room importing another, and torch_dist/
    importing legacy/ (lazily) are each reported; a room importing the native format and megatron/'s own
    level opening a format's room are not."""
    ck = tmp_path / "megalite" / "checkpointing"
    for d in ("hf", "megatron/torch_dist", "megatron/legacy"):
        (ck / d).mkdir(parents=True)
    files = {
        "reader.py": "from megalite.checkpointing.megatron import read\n",
        "megatron/read.py": "def f():\n    from megalite.checkpointing.megatron.legacy import reader\n",
        "megatron/legacy/reader.py": "from megalite.checkpointing.reader import X\n",
        "megatron/torch_dist/dp_optim.py": "def f():\n    from megalite.checkpointing.megatron.legacy.reader "
                                           "import j\n",
        "hf/convert.py": "import megalite.checkpointing.megatron.names\n",
    }
    for name, text in files.items():
        (ck / name).write_text(text)
    assert room_violations(tmp_path) == [
        "megalite/checkpointing/hf/convert.py:1: hf imports megalite.checkpointing.megatron.names (megatron)",
        "megalite/checkpointing/megatron/torch_dist/dp_optim.py:2: megatron.torch_dist imports "
        "megalite.checkpointing.megatron.legacy.reader (megatron.legacy)",
        "megalite/checkpointing/reader.py:1: native imports megalite.checkpointing.megatron.read (megatron)"]
