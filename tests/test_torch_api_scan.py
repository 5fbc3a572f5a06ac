"""Every torch name megalite reaches statically exists in the minimum torch release.

megalite/compat.py is the one module that adapts to the torch it runs on; everywhere else a newer (or
removed) torch attribute would break the oldest supported release only when that line runs. This scan parses
the sources (no torch import, so it is fast and runs on any torch), resolves each attribute chain rooted at a
name bound to torch or a torch submodule, and looks it up in the API recorded from the minimum release
(tests/golden/torch_api_<major>.<minor>.json, made by scripts/record_torch_api.py). String-based look-ups on
torch (``getattr(torch, name)``) cannot be checked, so outside compat.py they fail as unscannable.
"""

from __future__ import annotations

import ast
import functools
import json
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("megalite", "tools", "tasks", "pretrain_gpt.py")  # tests/ and bench/ may use any torch
EXEMPT = frozenset({"megalite/compat.py"})
DYNAMIC_LOOKUPS = frozenset({"getattr", "hasattr", "setattr", "delattr"})
IMPORTERS = frozenset({"import_module", "__import__"})


@dataclass(frozen=True)
class Use:
    """One torch name a source reaches: ``kind`` is attr, import or dynamic (a string look-up)."""

    line: int
    name: str
    kind: str


@dataclass(frozen=True)
class Violation:
    """A use the minimum release cannot satisfy, with the reason."""

    path: str
    line: int
    name: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.name} ({self.reason})"


# ---- the scanner: which torch names a source uses ---------------------------------------------------
def _chain(node: ast.expr) -> tuple[str, list[str]] | None:
    """(root name, attributes) of ``a.b.c``; None when the chain is not rooted at a plain name."""
    attrs: list[str] = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return node.id, attrs[::-1]


def _targets(node: ast.AST) -> list[str]:
    """Plain names an assignment-like target binds (tuples unpacked)."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Tuple | ast.List):
        return [n for elt in node.elts for n in _targets(elt)]
    if isinstance(node, ast.Starred):
        return _targets(node.value)
    return []


class _Scanner(ast.NodeVisitor):
    """Collects the torch names a module uses. Bindings follow function and class scopes: a parameter or
    local that reuses an alias's name (``dist``) hides it; ``x = torch.cuda`` makes ``x`` an alias."""

    def __init__(self) -> None:
        self.scopes: list[dict[str, str | None]] = [{}]
        self.uses: list[Use] = []

    def lookup(self, name: str) -> str | None:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        return None

    def resolve(self, node: ast.expr) -> str | None:
        """The dotted torch name an expression denotes statically, or None."""
        chain = _chain(node)
        if chain is None or (base := self.lookup(chain[0])) is None:
            return None
        return ".".join([base, *chain[1]])

    def bind(self, name: str, dotted: str | None) -> None:
        self.scopes[-1][name] = dotted

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] == "torch":
                self.uses.append(Use(node.lineno, alias.name, "import"))
                self.bind(alias.asname or "torch", alias.name if alias.asname else "torch")
            else:
                self.bind(alias.asname or alias.name.split(".")[0], None)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        torch_module = node.level == 0 and module.split(".")[0] == "torch"
        if torch_module:
            self.uses.append(Use(node.lineno, module, "import"))
        for alias in node.names:
            dotted = f"{module}.{alias.name}" if torch_module and alias.name != "*" else None
            if dotted:
                self.uses.append(Use(node.lineno, dotted, "attr"))
            self.bind(alias.asname or alias.name, dotted)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        dotted = self.resolve(node)
        if dotted is None:
            self.generic_visit(node)
        else:
            self.uses.append(Use(node.lineno, dotted, "attr"))

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        first = node.args[0] if node.args else None
        if name in DYNAMIC_LOOKUPS and first is not None and (target := self.resolve(first)):
            self.uses.append(Use(node.lineno, f"{name}({target}, ...)", "dynamic"))
        elif (name in IMPORTERS and isinstance(first, ast.Constant) and isinstance(first.value, str)
              and first.value.split(".")[0] == "torch"):
            self.uses.append(Use(node.lineno, f"{name}({first.value!r})", "dynamic"))
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        alias = self.resolve(node.value)
        for target in node.targets:
            for name in _targets(target):
                self.bind(name, alias)
            if not isinstance(target, ast.Name):
                self.visit(target)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.generic_visit(node)
        for name in _targets(node.target):
            self.bind(name, self.resolve(node.value) if node.value else None)

    def visit_For(self, node: ast.For) -> None:
        for name in _targets(node.target):
            self.bind(name, None)
        self.generic_visit(node)

    visit_AsyncFor = visit_For

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        """Decorators, defaults and annotations in the enclosing scope; the body in a new one where the
        parameters hide outer names."""
        for expr in [*getattr(node, "decorator_list", []), *node.args.defaults, *node.args.kw_defaults]:
            if expr is not None:
                self.visit(expr)
        args = node.args
        params = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
        for arg in params:
            if arg is not None and arg.annotation is not None:
                self.visit(arg.annotation)
        if getattr(node, "returns", None) is not None:
            self.visit(node.returns)
        self.scopes.append({arg.arg: None for arg in params if arg is not None})
        for stmt in node.body if isinstance(node.body, list) else [node.body]:
            self.visit(stmt)
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for expr in [*node.decorator_list, *node.bases, *(k.value for k in node.keywords)]:
            self.visit(expr)
        self.scopes.append({})
        for stmt in node.body:
            self.visit(stmt)
        self.scopes.pop()


def torch_uses(source: str) -> list[Use]:
    """Every torch name ``source`` reaches statically, plus its string-based look-ups on torch."""
    scanner = _Scanner()
    scanner.visit(ast.parse(source))
    return scanner.uses


def scanned_files(root: Path = ROOT) -> list[Path]:
    """The sources held to the minimum API (tests/ and bench/ are not)."""
    files: list[Path] = []
    for entry in SCANNED:
        path = root / entry
        files.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return files


# ---- the check: does the minimum release have each name ---------------------------------------------
@dataclass(frozen=True)
class Api:
    """A recorded release: the attributes of its recorded namespaces (modules and classes), the names of
    its importable modules, and the names of the classes it defines."""

    version: str
    namespaces: dict[str, frozenset[str]]
    modules: frozenset[str]
    classes: frozenset[str]

    @classmethod
    def from_record(cls, record: dict) -> Api:
        return cls(record["torch_version"], {k: frozenset(v) for k, v in record["namespaces"].items()},
                   frozenset(record["modules"]), frozenset(record["classes"]))


def record_path(root: Path = ROOT) -> Path:
    """The recorded API of the minimum release named by megalite/compat.py's MIN_TORCH."""
    tree = ast.parse((root / "megalite" / "compat.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "MIN_TORCH" for t in node.targets):
            major, minor = ast.literal_eval(node.value)
            return root / "tests" / "golden" / f"torch_api_{major}.{minor}.json"
    raise AssertionError("megalite/compat.py defines no MIN_TORCH")


@functools.cache
def minimum_api() -> Api:
    return Api.from_record(json.loads(record_path().read_text()))


def missing(use: Use, api: Api) -> str | None:
    """Why the minimum release lacks ``use``, or None. A chain is checked down through recorded modules and
    classes; past any other object (a function, a constant) the rest is the object's business."""
    if use.kind == "dynamic":
        return "string look-up on torch: unscannable, belongs in megalite/compat.py"
    if use.kind == "import":
        return None if use.name in api.modules else f"no module {use.name} in torch {api.version}"
    parts = use.name.split(".")
    current = parts[0]
    for part in parts[1:]:
        child = f"{current}.{part}"
        if current in api.namespaces:
            if part not in api.namespaces[current] and child not in api.modules:
                return f"torch {api.version} has no {child}"
        elif current in api.modules or current in api.classes:
            return f"{current} is not recorded: re-run scripts/record_torch_api.py with torch {api.version}"
        else:
            return None
        current = child
    return None


def violations(source: str, path: str, api: Api) -> list[Violation]:
    """The uses in ``source`` (at ``path``, relative to the repository) that the minimum release lacks."""
    if path in EXEMPT:
        return []
    found = []
    for use in torch_uses(source):
        reason = missing(use, api)
        if reason is not None:
            found.append(Violation(path, use.line, use.name, reason))
    return found


# ---- tests ------------------------------------------------------------------------------------------
SYNTHETIC = '''
import torch
import torch.distributed as dist
from torch import nn


def gather(out, inp, group):
    dist.all_gather_into_tensor(out, inp, group=group)
    dist.all_gather_single(out, inp, group=group)
    return torch._grouped_mm(inp, inp, offs=None)


def late():
    from torch.distributed import reduce_scatter_single
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return reduce_scatter_single, SDPBackend.NO_SUCH_BACKEND, sdpa_kernel, nn.functional.no_such_fn
'''


def test_tree_uses_only_the_minimum_torch_api():
    """No source outside compat.py reaches a torch name the minimum release lacks, or looks one up by string."""
    api = minimum_api()
    found = []
    for file in scanned_files():
        found += violations(file.read_text(), file.relative_to(ROOT).as_posix(), api)
    assert not found, ("torch names the minimum release lacks (reach them through megalite/compat.py):\n"
                       + "\n".join(map(str, found)))


def test_scanner_flags_names_absent_in_the_minimum():
    """Newer collectives and private kernels are flagged with file:line; the long-standing name is not."""
    found = {(v.line, v.name) for v in violations(SYNTHETIC, "megalite/x.py", minimum_api())}
    assert found == {(9, "torch.distributed.all_gather_single"), (10, "torch._grouped_mm"),
                     (14, "torch.distributed.reduce_scatter_single"),
                     (16, "torch.nn.attention.SDPBackend.NO_SUCH_BACKEND"),
                     (16, "torch.nn.functional.no_such_fn")}


def test_scanner_resolves_every_import_form():
    """Aliases, from-imports, function-level imports and assigned aliases all resolve to full torch names,
    and a local that reuses an alias's name hides it."""
    source = '''
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as ckpt
def f(dist):
    import torch.distributed as d
    aten = torch.ops.aten
    return F.gelu, d.ReduceOp.SUM, aten.mm.default, ckpt, dist.nope
'''
    names = {(u.name, u.kind) for u in torch_uses(source)}
    assert names == {("torch", "import"), ("torch.nn.functional", "import"), ("torch.utils.checkpoint", "import"),
                     ("torch.utils.checkpoint.checkpoint", "attr"), ("torch.distributed", "import"),
                     ("torch.ops.aten", "attr"), ("torch.nn.functional.gelu", "attr"),
                     ("torch.distributed.ReduceOp.SUM", "attr"), ("torch.ops.aten.mm.default", "attr")}
    assert not violations(source, "megalite/x.py", minimum_api())


def test_scanner_flags_string_lookups_as_unscannable():
    """getattr/hasattr on torch and importing torch by a string cannot be checked, so they fail outside
    compat.py."""
    source = '''
import importlib
import torch
import torch.distributed as dist
a = getattr(torch, "x")
b = hasattr(dist.distributed_c10d, name)
c = importlib.import_module("torch.distributed")
d = getattr(config, "x")
'''
    found = [(v.line, v.name) for v in violations(source, "tools/x.py", minimum_api())]
    assert found == [(5, "getattr(torch, ...)"), (6, "hasattr(torch.distributed.distributed_c10d, ...)"),
                     (7, "import_module('torch.distributed')")]


def test_compat_is_the_only_exemption():
    """compat.py may use anything; the same source anywhere else is flagged."""
    api = minimum_api()
    assert violations(SYNTHETIC, "megalite/compat.py", api) == []
    assert violations(SYNTHETIC, "megalite/parallel/groups.py", api)
    assert "megalite/compat.py" not in {f.relative_to(ROOT).as_posix() for f in scanned_files()} - EXEMPT


def test_record_is_of_the_minimum_release():
    """The record matches MIN_TORCH and describes the namespaces megalite relies on (a record made on the
    wrong torch, or cut short, would pass everything)."""
    record = json.loads(record_path().read_text())
    major, minor = record_path().stem.removeprefix("torch_api_").split(".")
    assert record["torch_version"].split(".")[:2] == [major, minor]
    required = {"torch", "torch.nn", "torch.nn.functional", "torch.distributed", "torch.ops.aten", "torch._C",
                "torch.Tensor", "torch.nn.Module", "torch.autograd.Function", "torch.distributed.ProcessGroup"}
    assert required <= record["namespaces"].keys()
    assert "all_gather_into_tensor" in record["namespaces"]["torch.distributed"]
    assert "mm" in record["namespaces"]["torch.ops.aten"]
