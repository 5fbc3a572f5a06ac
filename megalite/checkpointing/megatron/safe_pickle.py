"""Reading the pickles of a Megatron-LM checkpoint without running code from it.

A pickle names the functions that rebuild it, so loading one from an untrusted folder can run anything
(``os.system`` included). Megatron-LM's files are pickles: torch.save'd zip files (``common.pt``, the
legacy ``model_optim_rng.pt``, each tensor inside a ``__N_M.distcp``) and a plain pickle (``.metadata``,
torch.distributed.checkpoint's index). Both readers here resolve only the names of an explicit allow-list,
and refuse any other in one line naming the file and ``module.name``:

- torch zip files: ``torch.load(weights_only=True)`` (torch's own restricted unpickler: tensors, storages,
  dtypes, plain containers) with the few extra names Megatron's files hold made safe for the call
  (``SAFE_TORCH_GLOBALS``): ``argparse.Namespace`` (the saved args), ``io.BytesIO`` (Transformer Engine's
  ``_extra_state`` in a legacy state dict: bytes, never executed), Megatron's enums as inert stand-ins
  (``Standin``, holding the value), and numpy's RNG-state pieces.
- ``.metadata``: a ``pickle.Unpickler`` whose ``find_class`` maps each allowed
  torch.distributed.checkpoint class to an inert ``Record`` (attributes only), ``torch.Size`` to a tuple
  and dtypes to torch's dtype objects; nothing of torch.distributed.checkpoint is imported or called.
"""

from __future__ import annotations

import argparse
import io
import pickle
import re
from typing import Any, BinaryIO

import numpy as np
import torch

from megalite import compat
from megalite.checkpointing.errors import CheckpointError


class UnsafePickleError(CheckpointError):
    """A pickle names a global outside the allow-list; it was not loaded (nothing of it ran)."""


def refusal(where: str, name: str) -> UnsafePickleError:
    return UnsafePickleError(f"{where}: refused to unpickle {name}: not on the allow-list of Megatron "
                             "checkpoint types (docs/checkpoints.md, 'Megatron-LM checkpoints'); nothing was run")


# ---- .metadata: inert records -------------------------------------------------------------------


class Record:
    """A stand-in for an allowed class: it keeps the state the pickle gives it and does nothing else."""

    def __init__(self, *args: Any) -> None:  # an enum member: Enum(value)
        self.value = args[0] if args else None

    def __setstate__(self, state: Any) -> None:
        slots = None
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict | None):
            state, slots = state
        if not isinstance(state, dict | None):  # a class's own state tuple (TensorProperties: dtype first)
            self.state = state
            return
        for part in (state, slots):
            if isinstance(part, dict):
                self.__dict__.update({str(k): v for k, v in part.items()})

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


_DCP = "torch.distributed.checkpoint"
METADATA_RECORDS: dict[tuple[str, str], type[Record]] = {
    (f"{_DCP}.{module}", name): type(name, (Record,), {})
    for module, names in {
        "metadata": ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
                     "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"),
        "planner": ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"),
        "filesystem": ("_StorageInfo",),
    }.items() for name in names}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
          "bool": torch.bool}


def _size(*args: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in args[0]) if args else ()


def _layout(name: Any = None) -> str:
    return str(name)


class RestrictedUnpickler(pickle.Unpickler):
    """Resolves only METADATA_RECORDS, ``torch.Size``, dtypes and the layout helper; any other name is refused."""

    def __init__(self, file: BinaryIO, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_RECORDS:
            return METADATA_RECORDS[module, name]
        if module == "torch" and name == "Size":
            return _size
        if module == "torch" and name in DTYPES:
            return DTYPES[name]
        if module == "torch.serialization" and name == "_get_layout":
            return _layout
        raise refusal(self.where, f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise refusal(self.where, f"a persistent id {str(pid)[:40]!r}")


def load_plain_pickle(path: str) -> Any:
    """A plain pickle (torch.distributed.checkpoint's ``.metadata``) read with RestrictedUnpickler."""
    try:
        with open(path, "rb") as f:
            return RestrictedUnpickler(f, path).load()
    except UnsafePickleError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise CheckpointError(f"{path}: not a readable pickle ({type(e).__name__}: {e})") from None


# ---- torch zip files: weights_only plus stand-ins -----------------------------------------------


def _standin(module: str, name: str, base: type = Record) -> type:
    """An inert class that torch's weights_only unpickler knows by Megatron's ``module.name``."""
    cls = type(name, (base,), {})
    cls.__module__, cls.__qualname__ = module, name
    return cls


def _numpy_function(module: str, fn: Any) -> Any:
    """numpy's array-rebuild function under the name the pickle gives it (numpy 1 and 2 differ)."""
    def rebuild(*args: Any) -> Any:
        return fn(*args)
    rebuild.__module__, rebuild.__qualname__ = module, "_reconstruct"
    return rebuild


MEGATRON_ENUMS = {
    "megatron.core.enums": ("ModelType", "Fp8Recipe", "Fp4Recipe"),
    "megatron.core.transformer.enums": ("ModelType", "LayerType", "AttnType", "AttnMaskType", "AttnBackend",
                                        "CudaGraphScope"),
    "megatron.core.rerun_state_machine": ("RerunDiagnostic", "RerunMode", "RerunState", "RerunValidationStatus"),
    "megatron.core.optimizer.optimizer_config": ("ParamKey",),
}


def _numpy_globals() -> list[Any]:
    core = getattr(np, "_core", None) or np.core  # numpy 2's name; numpy 1 has only np.core
    out: list[Any] = [np.ndarray, np.dtype]
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        out.append(_numpy_function(module, core.multiarray._reconstruct))
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:  # numpy >= 1.25 pickles a dtype as an instance of its class
        out += [getattr(dtypes, n) for n in ("UInt32DType", "Int64DType", "Float64DType", "Float32DType")
                if hasattr(dtypes, n)]
    return out


SAFE_TORCH_GLOBALS: list[Any] = [argparse.Namespace, io.BytesIO] + [
    _standin(module, name) for module, names in MEGATRON_ENUMS.items() for name in names]


_UNSUPPORTED = re.compile(r"GLOBAL ([\w.]+)|Unsupported global: (?:GLOBAL )?([\w.]+)|global '?([\w.]+)")


def load_torch_file(source: str | bytes, where: str | None = None) -> Any:
    """A torch.save'd file (a path, or its bytes) loaded with ``weights_only=True`` and the allow-list;
    a refused global is named in one line with the file."""
    where = where or str(source)
    stream: Any = io.BytesIO(source) if isinstance(source, bytes) else source
    try:
        return compat.load_weights_only(stream, SAFE_TORCH_GLOBALS + _numpy_globals())
    except pickle.UnpicklingError as e:
        m = _UNSUPPORTED.search(str(e))
        if m:
            raise refusal(where, next(g for g in m.groups() if g)) from None
        raise CheckpointError(f"{where}: not a readable torch file ({str(e).splitlines()[0]})") from None
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise CheckpointError(f"{where} is missing") from None
        raise CheckpointError(f"{where}: not a readable torch file ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None
