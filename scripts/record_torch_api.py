"""Record the API of the torch this python runs, for tests/test_torch_api_scan.py.

Run it with the minimum supported release (megalite/compat.py's MIN_TORCH), e.g.
``~/.cache/megalite-torch/torch-2.6.0/bin/python scripts/record_torch_api.py``; it writes
tests/golden/torch_api_<major>.<minor>.json. The scan test then fails on any torch name outside compat.py
that this release lacks, without needing that release installed. Recorded: the attribute names (``dir``)
of a fixed list of modules and classes, and of every further torch module or class that megalite's sources
reach through a dotted path; the registered operator names of ``torch.ops.<namespace>`` (its ``dir`` is
lazy); the names of every importable torch module; and the names of the classes torch defines.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import json
import platform
import sys
import warnings
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.test_torch_api_scan import scanned_files, torch_uses  # noqa: E402

MODULES = (
    "torch", "torch.nn", "torch.nn.functional", "torch.nn.init", "torch.nn.attention", "torch.nn.utils",
    "torch.nn.parameter", "torch.distributed", "torch.distributed.distributed_c10d", "torch.autograd",
    "torch.autograd.graph", "torch.utils", "torch.utils.checkpoint", "torch.utils.data", "torch.cuda",
    "torch.cuda.amp", "torch.amp", "torch.backends", "torch.backends.cuda", "torch.backends.cudnn",
    "torch.profiler", "torch.linalg", "torch.optim", "torch.optim.lr_scheduler", "torch.special",
    "torch.testing", "torch.multiprocessing", "torch.version", "torch._C", "torch.ops", "torch.ops.aten",
)
CLASSES = (
    "torch.Tensor", "torch.nn.Module", "torch.nn.Parameter", "torch.autograd.Function",
    "torch.autograd.function.FunctionCtx", "torch.distributed.ProcessGroup", "torch.distributed.ReduceOp",
    "torch.distributed.P2POp", "torch.distributed.Work", "torch.distributed.Store", "torch.distributed.TCPStore",
    "torch.Generator", "torch.dtype", "torch.finfo", "torch.iinfo", "torch.device", "torch.Size",
    "torch.cuda.Stream", "torch.cuda.Event", "torch.profiler.profile", "torch.profiler.ProfilerActivity",
    "torch.nn.attention.SDPBackend", "torch.optim.Optimizer", "torch.utils.data.Dataset",
)


def _all_op_names() -> list[str]:
    """Every registered operator as ``namespace::name[.overload]``."""
    return list(torch._C._dispatch_get_all_op_names())


def op_namespace(dotted: str) -> list[str] | None:
    """``torch.ops``: its operator namespaces; ``torch.ops.<ns>``: the operator names registered there."""
    if dotted == "torch.ops":
        return sorted({n.split("::")[0] for n in _all_op_names()} | set(dir(torch.ops)))
    if dotted.startswith("torch.ops.") and dotted.count(".") == 2:
        prefix = dotted.removeprefix("torch.ops.") + "::"
        return sorted({n.removeprefix(prefix).split(".")[0] for n in _all_op_names() if n.startswith(prefix)})
    return None


def module_names() -> list[str]:
    """Every torch module importable by name: the package's files (without importing them) plus the
    extension submodules already loaded (``torch._C._nn``)."""
    base = Path(torch.__file__).parent
    names = set()
    for file in base.rglob("*"):
        if file.suffix not in (".py", ".so", ".pyd") or "include" in file.relative_to(base).parts:
            continue
        parts = file.relative_to(base).with_suffix("").parts
        parts = (*parts[:-1], parts[-1].split(".")[0])  # _C.cpython-311-x86_64-linux-gnu
        if all((base.joinpath(*parts[:i]) / "__init__.py").exists() for i in range(1, len(parts))):
            names.add(".".join(("torch", *parts)).removesuffix(".__init__"))
    names.update(n for n in sys.modules if n.startswith("torch."))
    return sorted(names)


def resolve(dotted: str, modules: set[str]) -> object | None:
    """The object at ``dotted`` in this torch (importing submodules on the way), or None."""
    obj: object = torch
    path = "torch"
    for part in dotted.split(".")[1:]:
        path = f"{path}.{part}"
        try:
            obj = getattr(obj, part) if hasattr(obj, part) or path not in modules else importlib.import_module(path)
        except Exception:  # noqa: BLE001 - a module that cannot load here (a missing optional dependency)
            return None
    return obj


def static_names(dotted: str) -> list[str] | None:
    """The top-level names a module's source binds, for a module that cannot be imported here."""
    try:
        spec = importlib.util.find_spec(dotted)
    except Exception:  # noqa: BLE001 - its parent cannot load either
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    names = set()
    for node in ast.parse(Path(spec.origin).read_text()).body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return sorted(names)


def used_namespaces(modules: set[str]) -> set[str]:
    """Every prefix of a dotted torch name megalite's sources use that is a module or a class here."""
    found = set()
    for file in scanned_files(ROOT):
        for use in torch_uses(file.read_text()):
            if use.kind == "dynamic":
                continue
            parts = use.name.split(".")
            for i in range(1, len(parts)):
                prefix = ".".join(parts[:i])
                if prefix in modules or inspect.isclass(resolve(prefix, modules)):
                    found.add(prefix)
    return found


def namespace(dotted: str, modules: set[str]) -> tuple[list[str] | None, str]:
    """(attribute names, how they were found) of one module or class."""
    ops = op_namespace(dotted)
    if ops is not None:
        return ops, "registered operators"
    obj = resolve(dotted, modules)
    if isinstance(obj, ModuleType):
        return sorted(dir(obj)), "dir"
    if inspect.isclass(obj):  # a class also answers its metaclass's attributes (dist.group.WORLD)
        return sorted(set(dir(obj)) | set(dir(type(obj)))), "dir"
    names = static_names(dotted) if dotted in modules else None
    return names, "source (not importable here)"


def classes_in(namespaces: dict[str, list[str]], modules: set[str]) -> list[str]:
    """The dotted names, within the recorded namespaces, of classes torch defines."""
    found = set()
    for dotted, names in namespaces.items():
        if op_namespace(dotted) is not None:
            continue
        obj = resolve(dotted, modules)
        for name in names:
            value = getattr(obj, name, None) if obj is not None else None
            if inspect.isclass(value) and (getattr(value, "__module__", None) or "").startswith("torch"):
                found.add(f"{dotted}.{name}")
    return sorted(found)


def record() -> dict:
    """The whole record of this torch."""
    modules = module_names()
    known = set(modules)
    namespaces, static = {}, []
    for dotted in sorted(set(MODULES) | set(CLASSES) | used_namespaces(known)):
        names, how = namespace(dotted, known)
        if names is None:
            raise SystemExit(f"record_torch_api: {dotted} is neither a module nor a class in torch "
                             f"{torch.__version__}")
        namespaces[dotted] = names
        if how.startswith("source"):
            static.append(dotted)
    return {
        "torch_version": torch.__version__,
        "made_by": f"scripts/record_torch_api.py under python {platform.python_version()}",
        "how": "namespaces: dir() of each module, and of each class with its metaclass (torch.ops.<ns>: the "
               "registered operator names; those under read_from_source: their source's top-level names); "
               "modules: every importable torch module; classes: the classes torch defines inside the recorded "
               "namespaces",
        "read_from_source": static,
        "modules": modules,
        "classes": classes_in(namespaces, known),
        "namespaces": namespaces,
    }


def main() -> None:
    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "golden" / f"torch_api_{version}.json")
    args = parser.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data = record()
    args.out.write_text(json.dumps(data, indent=0, sort_keys=True) + "\n")
    print(f"{args.out}: torch {data['torch_version']}, {len(data['namespaces'])} namespaces, "
          f"{len(data['modules'])} modules, {len(data['classes'])} classes, {args.out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
