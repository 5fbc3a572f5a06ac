"""Megatron-LM's legacy ``torch`` checkpoint format merged into full tensors under megatron-core names.

An iteration folder holds one ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` per (TP rank, PP rank, EP
rank): a torch.save'd dict of ``model`` (the rank's state dict; ``model0``, ``model1``, ... per model
chunk with interleaving), ``args``, ``iteration``, ``checkpoint_version``, optimizer and RNG state. Layer
numbers are local to each chunk and expert numbers local to each EP rank. Merging:

- pipeline: chunk c of stage p is virtual stage c·PP + p; its layers follow those of the virtual stages
  before it (counted from the files, so uneven stages need no flag);
- tensor parallel: column-parallel tensors (embedding and output rows, QKV — each rank holds whole KV
  groups, so the per-group order survives —, fc1) are joined on dim 0, row-parallel weights (proj, fc2)
  on dim 1, everything else is replicated and must be equal on every rank; SwiGLU's fc1 holds
  [gate_r; up_r] per rank and is joined as [gate_0 … gate_n; up_0 … up_n];
- expert parallel: EP rank e's local expert j is expert e·E/EP + j.

The optimizer state each file holds (torch's numbering of the rank's parameters) is read by
legacy/optim.py, the distributed optimizer's (each rank's ``distrib_optim.pt``) by
legacy/distrib_optim.py; either is joined like the weights and offered under torch_dist's optimizer keys.

Each file is read through safe_pickle.py; missing files, unknown or inconsistent keys are named.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

import torch

from megalite.checkpointing.errors import CheckpointError
from megalite.checkpointing.megatron.legacy.distrib_optim import distrib_file, distrib_moments, is_distributed
from megalite.checkpointing.megatron.legacy.optim import legacy_moments
from megalite.checkpointing.megatron.names import BUFFERS, OPTIMIZER_STATE
from megalite.checkpointing.megatron.safe_pickle import load_torch_file
from megalite.checkpointing.megatron.tp import join_tp, whole_rows

FILE = "model_optim_rng.pt"
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\..+)$")
LOCAL_EXPERT_KEY = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")
SKIPPED = re.compile(r"(^|\.)_extra_state$")
OPTIM_NAMES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "main": "fp32_param"}  # -> torch_dist's names


def _grid(folder: str) -> dict[tuple[int, int, int], str]:
    """(tp, pp, ep) rank -> its file, every rank of the grid present."""
    files = {}
    for path in glob.glob(os.path.join(folder, "mp_rank_*")):
        m = RANK_DIR.match(os.path.basename(path))
        if m:
            files[int(m[1]), int(m[2] or 0), int(m[3] or 0)] = os.path.join(path, FILE)
    if not files:
        raise CheckpointError(f"{folder}: no mp_rank_*/{FILE}")
    sizes = [max(k[i] for k in files) + 1 for i in range(3)]
    for t in range(sizes[0]):
        for p in range(sizes[1]):
            for e in range(sizes[2]):
                path = files.get((t, p, e))
                if path is None or not os.path.isfile(path):
                    raise CheckpointError(f"{folder}: {FILE} of TP rank {t}, PP rank {p}, EP rank {e} is missing "
                                          f"(the folder holds TP {sizes[0]} x PP {sizes[1]} x EP {sizes[2]} ranks)")
    return files


def _ep_without_pp(files: dict[tuple[int, int, int], str], args: Any) -> bool:
    """Whether ``mp_rank_TT_XXX`` names EP ranks: Megatron-LM adds the PP rank only when PP > 1 and the EP
    rank only when EP > 1, so a single suffix is the EP rank when the saved args say PP 1."""
    single = all(k[2] == 0 for k in files) and any(k[1] for k in files)
    return single and getattr(args, "pipeline_model_parallel_size", None) == 1


def _chunks(state: dict[str, Any], path: str) -> list[dict[str, torch.Tensor]]:
    """The model state dict of each model chunk in one file (``model``, or ``model0``, ``model1``...)."""
    if "model" in state:
        chunks = [state["model"]]
    else:
        names = sorted((k for k in state if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))
        chunks = [state[k] for k in names]
    if not chunks or not all(isinstance(c, dict) for c in chunks):
        raise CheckpointError(f"{path}: holds no 'model' state dict (keys {sorted(state)[:8]})")
    out = []
    for c in chunks:
        bad = [k for k, v in c.items() if not SKIPPED.search(k) and not isinstance(v, torch.Tensor)]
        if bad:
            raise CheckpointError(f"{path}: {bad[0]} is a {type(c[bad[0]]).__name__}, not a tensor")
        out.append({k: v for k, v in c.items() if not SKIPPED.search(k)})
    return out


def _layer_counts(chunk: dict[str, torch.Tensor]) -> int:
    return len({int(m[2]) for k in chunk if (m := LAYER.match(k))})


class LegacyCheckpoint:
    """One legacy iteration folder: ``keys()``, ``tensor(key)`` (full, per-layer megatron-core names),
    ``common`` (args, iteration, checkpoint_version of TP 0 / PP 0's file)."""

    def __init__(self, folder: str) -> None:
        self.folder = self.where = folder
        files = _grid(folder)
        states = {k: load_torch_file(path) for k, path in files.items()}
        for k, s in states.items():
            if not isinstance(s, dict):
                raise CheckpointError(f"{files[k]}: holds a {type(s).__name__}, not the dict Megatron-LM saves")
        first = states[0, 0, 0]
        if _ep_without_pp(files, first.get("args")):  # mp_rank_TT_EEE: the one suffix is the EP rank
            files, states = ({(t, 0, x): v for (t, x, _), v in d.items()} for d in (files, states))
        self.tp, self.pp, self.ep = (max(k[i] for k in files) + 1 for i in range(3))
        self.common = {k: v for k, v in first.items() if k in ("args", "iteration", "checkpoint_version")}
        self.rng = {(t, p): s.get("rng_state") for (t, p, e), s in states.items() if e == 0}  # per (TP, PP) rank
        self.swiglu = bool(getattr(first.get("args"), "swiglu", False))
        self.whole = whole_rows(first.get("args"))  # MLA's down-projections: whole on each rank under TE's spec
        chunks = {k: _chunks(s, files[k]) for k, s in states.items()}
        self._shards = self._globalise(chunks, files)
        self._optim: dict[str, dict[str, list]] = {}
        self.optimizer_note = "the checkpoint holds no optimizer state"
        if all(s.get("optimizer") is not None for s in states.values()):
            self._read_optimizer(states, chunks, files)

    def _read_optimizer(self, states: dict, chunks: dict, files: dict) -> None:
        """Each rank's Adam state by parameter name (legacy/optim.py; the distributed optimizer's
        distrib_optim.pt: legacy/distrib_optim.py), globalised and joined as the weights are; the step into
        ``common`` as torch_dist keeps it. Not read: the reason in the note."""
        args = states[0, 0, 0].get("args")
        if is_distributed(list(files.values()), args):  # its parameter state in each rank's distrib_optim.pt
            per_file = {k: distrib_moments(distrib_file(files[k]), s["optimizer"], chunks[k], args, (k[1], self.pp))
                        for k, s in states.items()}
        else:
            per_file = {k: _named(files[k], legacy_moments(s["optimizer"], chunks[k])) for k, s in states.items()}
        reasons = [r for r in per_file.values() if isinstance(r, str)]
        steps = {r[1] for r in per_file.values() if not isinstance(r, str)}
        if reasons or len(steps) != 1:
            self.optimizer_note = reasons[0] if reasons else f"its files' optimizer steps differ ({sorted(steps)})"
            return
        for field in {f for r in per_file.values() for c in r[0] for f in c}:
            self._optim[OPTIM_NAMES[field]] = self._globalise(
                {k: [c.get(field, {}) for c in r[0]] for k, r in per_file.items()}, files)
        missing = [k for per in self._optim.values() for k in self._shards if k not in per and not BUFFERS.search(k)]
        if missing:  # e.g. an EP run's dense state, saved in its EP rank 0's files only, missing there
            self._optim = {}
            self.optimizer_note = f"{self.folder}: no rank's file holds the optimizer state of {missing[0]}"
            return
        self.common["optimizer"] = {"state": {"common_step": steps.pop()}}

    def _globalise(self, chunks: dict[tuple[int, int, int], list[dict]], files: dict) -> dict[str, list]:
        """Global key -> [TP shard 0, 1, ...], layers and experts renumbered."""
        vp = len(chunks[0, 0, 0])
        counts = {(p, c): _layer_counts(chunks[0, p, 0][c]) for p in range(self.pp) for c in range(vp)}
        order = sorted(counts, key=lambda pc: pc[1] * self.pp + pc[0])
        offset, start = 0, {}
        for pc in order:
            start[pc] = offset
            offset += counts[pc]
        shards: dict[str, dict[int, torch.Tensor]] = {}
        for (t, p, e), per_chunk in chunks.items():
            if len(per_chunk) != vp:
                raise CheckpointError(f"{files[t, p, e]}: holds {len(per_chunk)} model chunks, TP 0 / PP 0 {vp}")
            for c, sd in enumerate(per_chunk):
                local = len({int(y[2]) for k in sd if (y := LOCAL_EXPERT_KEY.search(k))})  # experts per EP rank
                for key, value in sd.items():
                    g = self._global_key(key, start[p, c], e * local)
                    if (p > 0 or c > 0) and g.startswith("embedding.") and g in shards:
                        continue  # a tied embedding copy on a later stage
                    shards.setdefault(g, {})[t] = value
        out = {}
        for g, per in shards.items():
            if sorted(per) != list(range(self.tp)):
                raise CheckpointError(f"{self.folder}: {g} is held by TP ranks {sorted(per)}, not all {self.tp}")
            out[g] = [per[t] for t in range(self.tp)]
        return out

    @staticmethod
    def _global_key(key: str, layer_offset: int, expert_offset: int) -> str:
        m = LAYER.match(key)
        if m:
            key = f"{m[1]}{int(m[2]) + layer_offset}{m[3]}"
        x = LOCAL_EXPERT_KEY.search(key)
        if x and expert_offset:
            key = key[:x.start()] + f"{x[1]}{expert_offset + int(x[2])}{x[3]}"
        return key

    def keys(self) -> list[str]:
        """The weights' keys, and the optimizer's as torch_dist names them (``optimizer.state.exp_avg.<key>``)."""
        return list(self._shards) + [f"optimizer.state.{f}.{k}" for f, shards in self._optim.items() for k in shards]

    def tensor(self, key: str) -> torch.Tensor:
        m = OPTIMIZER_STATE.match(key)
        parts = self._optim[m[1]][m[2]] if m else self._shards[key]
        return join_tp(m[2] if m else key, parts, self.swiglu, self.folder, self.whole)


def _named(path: str, got: Any) -> Any:
    """A reason a rank's state is not read, prefixed with its file."""
    return f"{path}: {got}" if isinstance(got, str) else got
