"""The weight files of a local Hugging Face folder, checked before anything is built from them.

from-hf reads the files itself instead of through ``from_pretrained``, which silently drops tensors
its model has no place for (a config declaring fewer layers than the weights), fills missing ones with
random values and fails late on a truncated file. Here, in order and before any tensor is loaded:

1. the files: ``model.safetensors`` or its ``.index.json`` shards (else ``pytorch_model.bin`` or its
   shards); each safetensors header is read and checked against the file's size (header length, every
   tensor's data offsets and byte count), naming the file and tensor;
2. every stored tensor is matched with the tensors the config's transformers model has (built on the
   meta device: names and shapes, no memory): a tensor the model has no place for, one it lacks, and a
   shape that differs are refused by name, expected and found shapes given;
3. only then are the tensors loaded, into the names and layout transformers itself uses (MoE experts
   stacked as in moe.py; the per-expert patterns and stored-name renames are the adapter's).

What the files may hold besides: buffers transformers never loads (GPT-2's causal-mask ``attn.bias`` /
``attn.masked_bias``, ``rotary_emb.inv_freq``), an ``lm_head.weight`` of a tied model (transformers ties
it to the embedding, so the import does too), and keys without the model's prefix (``h.0...`` for
``transformer.h.0...``, as the original GPT-2 files are written).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from megalite.checkpointing.hf.common import HFConversionError
from megalite.config.strict_load import load_json

SAFETENSORS, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
NEVER_LOADED = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")  # buffers, not weights
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


@dataclass(frozen=True)
class ExpertFiles:
    """Per-expert tensors as some files store them, stacked into transformers' ``mlp.experts.gate_up_proj``
    and ``down_proj`` (moe.py). ``pattern``'s groups: the layer prefix (``model.layers.3.``), the expert
    index and the part's stored name, which ``parts`` maps to gate, up or down."""

    pattern: re.Pattern
    parts: Mapping[str, str]


@dataclass
class Stored:
    """One tensor in the files: where it is, its shape, and how to load it."""

    file: str
    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]


# ---- 1. the files ---------------------------------------------------------------------------------


def weight_files(folder: str) -> list[str]:
    """The folder's weight files, as transformers looks for them (safetensors first)."""
    for index, single in ((SAFE_INDEX, SAFETENSORS), (BIN_INDEX, BIN)):
        path = os.path.join(folder, index)
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    shards = load_json(f.read(), path)["weight_map"].values()
                names = sorted({str(s) for s in shards})
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise HFConversionError(f"{path}: not a weight index (a JSON object with a 'weight_map' of "
                                        f"tensor -> file): {type(e).__name__}: {e}") from None
            missing = [n for n in names if not os.path.isfile(os.path.join(folder, n))]
            if missing:
                raise HFConversionError(f"{path} names {missing[0]}, which is not in {folder}")
            return [os.path.join(folder, n) for n in names]
        if os.path.isfile(os.path.join(folder, single)):
            return [os.path.join(folder, single)]
    raise HFConversionError(f"--load {folder}: no weights there (model.safetensors or pytorch_model.bin)")


def _header_error(path: str, why: str) -> HFConversionError:
    return HFConversionError(f"{path}: truncated or not a safetensors file: {why}")


def safetensors_header(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor: (dtype, shape)} of a safetensors file whose header and data offsets fit the file's size."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _header_error(path, f"{size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            raise _header_error(path, f"the header length {n} runs past the end of the file ({size} bytes)")
        raw = f.read(n)
    try:
        header = load_json(raw.decode("utf-8"), path)  # a tensor named twice is refused, not resolved
    except (UnicodeDecodeError, ValueError) as e:
        raise _header_error(path, f"the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise _header_error(path, "the header is not a JSON object")
    data, out = size - 8 - n, {}
    for name, entry in header.items():
        if name != "__metadata__":
            out[name] = _header_entry(path, name, entry, data)
    return out


def _header_entry(path: str, name: str, entry: object, data: int) -> tuple[str, tuple[int, ...]]:
    """One tensor's header entry, checked: a known dtype, a shape, offsets inside the data, the right size."""
    try:
        dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        ok = dtype in DTYPE_BYTES and all(isinstance(d, int) and d >= 0 for d in (*shape, begin, end))
    except (TypeError, KeyError, ValueError):
        ok = False
    if not ok:
        raise _header_error(path, f"tensor {name}: malformed header entry {entry!r}")
    if not begin <= end <= data:
        raise _header_error(path, f"tensor {name}: data offsets [{begin}, {end}] run past the end of the data "
                                  f"({data} bytes)")
    if end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise _header_error(path, f"tensor {name}: {end - begin} bytes for shape {list(shape)} of {dtype}")
    return dtype, shape


def _safetensors_tensors(path: str) -> dict[str, Stored]:
    from safetensors import safe_open

    header = safetensors_header(path)
    try:
        handle = safe_open(path, framework="pt")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError, and OSError
        raise HFConversionError(f"{path}: safetensors cannot open it: {e}") from None

    def loader(name: str) -> Callable[[], torch.Tensor]:
        def load() -> torch.Tensor:
            try:
                return handle.get_tensor(name)
            except Exception as e:  # noqa: BLE001 - the file changed under us, or an unsupported dtype
                raise HFConversionError(f"{path}: tensor {name} cannot be read: {e}") from None
        return load

    return {name: Stored(path, shape, loader(name)) for name, (_, shape) in header.items()}


def _bin_tensors(path: str) -> dict[str, Stored]:
    try:
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (not zip) format cannot be memory-mapped
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - pickle, zipfile and torch raise several kinds on a damaged file
        raise HFConversionError(f"{path}: not a readable PyTorch state dict: {type(e).__name__}: {e}") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise HFConversionError(f"{path}: not a state dict of tensors")
    return {k: Stored(path, tuple(v.shape), lambda v=v: v) for k, v in sd.items()}


def stored_tensors(folder: str) -> dict[str, Stored]:
    """Every tensor of the folder's weight files (headers checked, nothing loaded for safetensors)."""
    out: dict[str, Stored] = {}
    for path in weight_files(folder):
        tensors = _safetensors_tensors(path) if path.endswith(".safetensors") else _bin_tensors(path)
        for name, t in tensors.items():
            if name in out:
                raise HFConversionError(f"tensor {name} is stored twice: in {out[name].file} and {path}")
            out[name] = t
    return out


# ---- 2. every stored tensor against the config's model ----------------------------------------------


def expected_shapes(model_cls: type, hf_config, where: str) -> tuple[dict[str, tuple[int, ...]], str]:
    """{tensor: shape} of the transformers model ``hf_config`` describes (built on the meta device, so
    nothing is allocated), and its base-model prefix."""
    try:
        with torch.device("meta"):
            model = model_cls(hf_config)
    except Exception as e:  # noqa: BLE001 - transformers raises several kinds on inconsistent sizes
        raise HFConversionError(f"{where}: transformers cannot build {model_cls.__name__} from it: "
                                f"{type(e).__name__}: {e}") from None
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}, model.base_model_prefix


def _natural(name: str) -> list:
    """Sort key: layer 10 after layer 9."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _canonical_names(stored: dict[str, Stored], shapes: dict, prefix: str,
                     renames: Sequence[tuple[str, str]] = ()) -> dict[str, Stored]:
    """Stored names as transformers names them: the base-model prefix added where the files leave it
    out, the adapter's ``renames`` (stored infix -> transformers infix) applied where the stored name is not
    the model's; buffers transformers never loads dropped."""
    out = {}
    for name, t in stored.items():
        if name.endswith(NEVER_LOADED):
            continue
        if name not in shapes and prefix and not name.startswith(prefix + ".") and f"{prefix}.{name}" in shapes:
            name = f"{prefix}.{name}"
        for old, new in renames:
            if name not in shapes and old in name and name.replace(old, new) in shapes:
                name = name.replace(old, new)
        out[name] = t
    return out


def _shape_error(name: str, t: Stored, want: tuple[int, ...], where: str) -> HFConversionError:
    return HFConversionError(f"{t.file}: tensor {name} has shape {list(t.shape)}, but {where} makes it "
                             f"{list(want)}: the config's sizes contradict the weights")


def _stack_experts(stored: dict[str, Stored], shapes: dict, where: str,
                   expert_files: Sequence[ExpertFiles] = ()) -> dict[str, Callable[[], torch.Tensor]]:
    """Per-expert files (the adapter's ``expert_files`` patterns) -> transformers' stacked
    ``mlp.experts.gate_up_proj`` [E, 2F, h] and ``down_proj`` [E, h, F]; each file's name and shape
    checked. The per-expert names are taken out of ``stored``."""
    groups: dict[str, dict[tuple[int, str], str]] = {}
    for name in list(stored):
        for files in expert_files:
            m = files.pattern.match(name)
            if m:
                groups.setdefault(m.group(1), {})[(int(m.group(2)), files.parts[m.group(3)])] = name
    out: dict[str, Callable[[], torch.Tensor]] = {}
    for layer, files in sorted(groups.items(), key=lambda kv: _natural(kv[0])):
        up_name, down_name = layer + "mlp.experts.gate_up_proj", layer + "mlp.experts.down_proj"
        if up_name not in shapes or down_name not in shapes:
            continue  # no experts there: left in ``stored``, refused as unused
        (e, f2, h), (_, _, f) = shapes[up_name], shapes[down_name]
        sample = next(iter(files.values()))
        want = {"gate": (f2 // 2, h), "up": (f2 // 2, h), "down": (h, f)}
        for (j, part), name in sorted(files.items(), key=lambda kv: _natural(kv[1])):
            if j < e and stored[name].shape != want[part]:
                raise _shape_error(name, stored[name], want[part], where)
        for j in range(e):
            for part in ("gate", "up", "down"):
                if (j, part) not in files:
                    raise HFConversionError(f"{stored[sample].file}: the weights have no expert {j} {part} "
                                            f"projection of {layer[:-1]} ({where} declares {e} experts)")
        loads = {k: stored.pop(name).load for k, name in files.items() if k[0] < e}
        out[up_name] = lambda lo=loads, e=e: torch.stack([torch.cat([lo[(j, "gate")](), lo[(j, "up")]()])
                                                         for j in range(e)])
        out[down_name] = lambda lo=loads, e=e: torch.stack([lo[(j, "down")]() for j in range(e)])
    return out


def matched_weights(stored: dict[str, Stored], shapes: dict[str, tuple[int, ...]], prefix: str, tied: bool,
                    where: str, expert_files: Sequence[ExpertFiles] = (),
                    renames: Sequence[tuple[str, str]] = ()) -> dict[str, Callable[[], torch.Tensor]]:
    """{transformers name: loader} once every stored tensor has its place in the model and every
    tensor of the model is stored with its shape; else the first offending tensor is named."""
    stored = _canonical_names(stored, shapes, prefix, renames)
    loads = _stack_experts(stored, shapes, where, expert_files)
    unused = sorted((n for n in stored if n not in shapes), key=_natural)
    if unused:
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        raise HFConversionError(f"{stored[unused[0]].file}: tensor {unused[0]}{more} has no place in the model "
                                f"{where} describes (does it declare fewer layers, experts or features than the "
                                "weights hold?); nothing is dropped silently")
    missing = [n for n in shapes if n not in stored and n not in loads and not (tied and n == "lm_head.weight")]
    if missing:
        raise HFConversionError(f"the weights have no tensor {missing[0]}, which the model {where} describes "
                                f"has{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}")
    for name, t in stored.items():
        if t.shape != shapes[name]:
            raise _shape_error(name, t, shapes[name], where)
    return {**{n: t.load for n, t in stored.items()}, **loads}


def read_checked_weights(folder: str, model_cls: type, hf_config, where: str,
                         expert_files: Sequence[ExpertFiles] = (),
                         renames: Sequence[tuple[str, str]] = (), outside: Callable[[list[str]], set[str]] | None = None
                         ) -> dict[str, torch.Tensor]:
    """The folder's state dict in transformers' names, every tensor checked against ``hf_config``
    before any is loaded (module doc); ``outside``: of the stored names, those the adapter maps beyond
    transformers' class (adapter.outside_model), taken as stored."""
    stored = stored_tensors(folder)
    aside = {n: stored.pop(n) for n in (outside(list(stored)) if outside else ())}
    shapes, prefix = expected_shapes(model_cls, hf_config, where)
    loads = matched_weights(stored, shapes, prefix, bool(getattr(hf_config, "tie_word_embeddings", False)), where,
                            expert_files, renames)
    return {**{name: load() for name, load in loads.items()}, **{n: t.load() for n, t in aside.items()}}


def write_beside(folder: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """Add tensors transformers' class has no place for (adapter.outside_model) to a save_pretrained folder:
    one more safetensors file named in the weight index (written when save_pretrained left a single file),
    which from-hf reads and transformers' from_pretrained loads around (as DeepSeek-V3's own checkpoints)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    index_path = os.path.join(folder, SAFE_INDEX)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            index = json.load(f)
        name = "model-beside.safetensors"
    else:
        first, name = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
        os.replace(os.path.join(folder, SAFETENSORS), os.path.join(folder, first))
        with safe_open(os.path.join(folder, first), "pt") as f:
            index = {"metadata": {}, "weight_map": dict.fromkeys(f.keys(), first)}
    # clones: the depths' copies of the embedding and head are one tensor, which safetensors refuses to share
    save_file({k: v.detach().clone() for k, v in tensors.items()}, os.path.join(folder, name),
              metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(tensors, name))
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
