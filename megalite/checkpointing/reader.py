"""Read a checkpoint of any layout back as full (layout-free) tensors, one parameter at a time.

Files are opened lazily with safetensors (no pickle, nothing executed). A parameter's full tensor is
rebuilt from its TP shards with the parameter's ShardSpec; an optimizer tensor from the flat slices
the DP ranks owned. A routed experts' weight (stored in ``expert_rank_*`` folders) is rebuilt the same way
over expert-TP within each EP rank's block of experts, then the blocks are stacked. A missing or
unreadable file raises an error naming it.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import torch
from safetensors import safe_open

from megalite.checkpointing.checksum import file_checksum
from megalite.checkpointing.errors import CheckpointError
from megalite.checkpointing.paths import (
    check_recorded_iteration,
    family_dirname,
    iteration_dir,
    optim_filename,
    read_tracker,
    shard_dirname,
)
from megalite.checkpointing.schema import check_optim_meta, load_metadata
from megalite.parallel.groups import Group
from megalite.tensor_parallel.param_meta import DENSE, FAMILIES, ParamFamily
from megalite.tensor_parallel.sharding import ShardSpec

GROUP_NAMES = {Group.TP: "TP", Group.ETP: "expert-TP", Group.EP: "EP"}  # in error messages


class CheckpointReader:
    def __init__(self, load_dir: str, iteration: int | None = None) -> None:
        self.iteration = read_tracker(load_dir) if iteration is None else iteration
        self.dir = iteration_dir(load_dir, self.iteration)
        meta_path = os.path.join(self.dir, "metadata.json")
        if not os.path.isfile(meta_path):
            raise CheckpointError(f"{meta_path} is missing: the tracker points at an incomplete checkpoint")
        self.meta: dict[str, Any] = load_metadata(meta_path)
        check_recorded_iteration(self.meta["iteration"], self.iteration, meta_path, "'iteration'")
        check_recorded_iteration(self.meta["state"].get("iteration", self.iteration), self.iteration, meta_path,
                                 "'state.iteration'")
        lay = self.meta["layout"]
        self.tp, self.pp, self.dp = lay["tp"], lay["pp"], lay["dp"]
        self.ep, self.etp = lay.get("ep", 1), lay.get("etp", self.tp)  # none recorded before experts existed
        self.checksums: dict[str, str] = self.meta.get("checksums") or {}  # none in older checkpoints
        self._verified: set[str] = set()
        self._handles: dict[str, Any] = {}
        self._regions: dict[str, dict[str, list]] = {}
        self._stage_of: dict[str, int] = {}
        # the sizes of the groups parameter families are cut and split over, as saved
        self.sizes = {Group.TP: self.tp, Group.ETP: self.etp, Group.EP: self.ep}
        self._family: dict[str, ParamFamily] = {}
        for pp in range(self.pp):
            for family in FAMILIES.values():
                path = os.path.join(self.dir, family_dirname(family, 0, 0, pp), "model.safetensors")
                # every stage has dense files; only stages holding e.g. MoE layers have expert files (then
                # metadata.json lists them: a listed file must be there)
                if family == DENSE or os.path.isfile(path) or os.path.relpath(path, self.dir) in self.checksums:
                    for key in self._open(path).keys():
                        self._stage_of[key] = pp
                        self._family[key] = family

    @property
    def config(self) -> dict[str, Any]:
        return self.meta["config"]

    @property
    def state(self) -> dict[str, Any]:
        return self.meta["state"]

    def keys(self) -> list[str]:
        return list(self._stage_of)

    def _model_path(self, tp: int, pp: int) -> str:
        return os.path.join(self.dir, shard_dirname(tp, pp), "model.safetensors")

    def has(self, key: str) -> bool:
        return key in self._stage_of

    def family(self, key: str) -> ParamFamily:
        """The parameter family whose folders store ``key`` (e.g. routed experts' weights, per expert-TP x EP
        rank)."""
        self.stage_of(key)
        return self._family[key]

    def grid(self, key: str) -> tuple[int, int]:
        """(ranks its spec cut it over, split blocks) as saved: (expert-TP, EP) for expert weights, else (TP, 1)."""
        family = self.family(key)
        return self.sizes[family.shard], self.sizes[family.split] if family.split is not None else 1

    def _shard_dir(self, key: str, tp: int, ep: int = 0) -> str:
        """The folder of ``key``'s shard ``tp`` (of its family's shard group) of split block ``ep``."""
        return os.path.join(self.dir, family_dirname(self.family(key), tp, ep, self.stage_of(key)))

    def verify(self, path: str) -> None:
        """Check a file of this checkpoint against the checksum metadata.json recorded when it was saved
        (once per file; files of checkpoints written before checksums existed are not checked)."""
        expected = self.checksums.get(os.path.relpath(path, self.dir))
        if expected is None or path in self._verified:
            return
        got = file_checksum(path)
        if got != expected:
            raise CheckpointError(f"checkpoint file {path} is corrupt or truncated: its checksum is {got}, "
                                  f"{os.path.join(self.dir, 'metadata.json')} recorded {expected} when it was "
                                  "saved; restore the file from a copy or load an earlier iteration")
        self._verified.add(path)

    def _open(self, path: str):
        if path not in self._handles:
            if not os.path.isfile(path):
                raise CheckpointError(f"checkpoint shard {path} is missing (saved with TP={self.tp}, PP={self.pp}"
                                      f"{self._grid_note(path)})")
            self.verify(path)
            try:
                self._handles[path] = safe_open(path, framework="pt")
            except Exception as e:  # noqa: BLE001 - safetensors raises several kinds
                raise CheckpointError(f"checkpoint shard {path} is corrupt or truncated: {e}") from None
        return self._handles[path]

    def _grid_note(self, path: str) -> str:
        """The split and shard sizes of the family whose folder holds ``path`` (none for dense files)."""
        folder = os.path.basename(os.path.dirname(path))
        for family in FAMILIES.values():
            if family.split is not None and folder.startswith(family.folder + "_"):
                return (f", {GROUP_NAMES[family.split]}={self.sizes[family.split]}, "
                        f"{GROUP_NAMES[family.shard]}={self.sizes[family.shard]}")
        return ""

    def _get(self, path: str, key: str) -> torch.Tensor:
        try:
            return self._open(path).get_tensor(key)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"checkpoint shard {path}: cannot read {key}: {e}") from None

    def stage_of(self, key: str) -> int:
        if key not in self._stage_of:
            raise CheckpointError(f"checkpoint {self.dir} has no parameter {key}")
        return self._stage_of[key]

    def _stack(self, key: str, spec: ShardSpec, local) -> torch.Tensor:
        """Full tensor from ``local(tp, ep)`` shards: unsharded over (expert-)TP, EP blocks stacked on dim 0."""
        cut, blocks = self.grid(key)
        parts = [spec.unshard([local(t, e) for t in range(cut)]) for e in range(blocks)]
        return torch.cat(parts, dim=0) if self.family(key).split is not None else parts[0]

    def full_param(self, key: str, spec: ShardSpec) -> torch.Tensor:
        """The full tensor of parameter ``key``, from the (expert-)TP and EP shards it was saved in."""
        return self._stack(key, spec, lambda t, e: self.local_param(key, t, e))

    def _optim_files(self, folder: str) -> list[str]:
        files = sorted(glob.glob(os.path.join(folder, "optim_dp_*.safetensors")))
        if not files:
            raise CheckpointError(f"no optimizer state in {folder} (expected {optim_filename(0)}); load with "
                                  "--no-load-optim to skip it")
        return files

    def has_optimizer(self) -> bool:
        return bool(glob.glob(os.path.join(self.dir, shard_dirname(0, 0), "optim_dp_*.safetensors")))

    def optimizer_step(self) -> float:
        path = self._optim_files(os.path.join(self.dir, shard_dirname(0, 0)))[0]
        return float(self._optim_meta(path)["step"])

    def _optim_meta(self, path: str) -> dict[str, Any]:
        """An optimizer file's checked ``meta``: its regions and Adam step."""
        try:
            raw = self._open(path).metadata()
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors raises several kinds
            raise CheckpointError(f"checkpoint shard {path}: cannot read its metadata: {e}") from None
        return check_optim_meta(raw, path)

    def local_param(self, key: str, tp: int, ep: int = 0) -> torch.Tensor:
        """The saved shard ``tp`` of parameter ``key`` (of EP block ``ep`` for an expert weight), as written."""
        return self._get(os.path.join(self._shard_dir(key, tp, ep), "model.safetensors"), key)

    def local_optim(self, key: str, field: str, tp: int, ep: int = 0) -> torch.Tensor:
        """Shard ``tp`` (of EP block ``ep``) of ``field`` (main, exp_avg, exp_avg_sq) of parameter ``key``,
        reassembled from the flat slices its (expert-)DP ranks owned."""
        folder = self._shard_dir(key, tp, ep)
        local, local_shape = None, None
        for path in self._optim_files(folder):
            if path not in self._regions:
                self._regions[path] = self._optim_meta(path)["regions"]
            regions = self._regions[path]
            if key not in regions:
                continue
            lo, hi, shape = regions[key]
            numel = int(torch.tensor(shape).prod()) if shape else 1
            part = self._get(path, f"{key}/{field}")
            if part.numel() != hi - lo:
                raise CheckpointError(f"checkpoint shard {path}: {key}/{field} holds {part.numel()} elements, its "
                                      f"region [{lo}, {hi}) says {hi - lo}")
            if local is None and (lo, hi) == (0, numel):  # one file holds all of it: no copy
                return part.view(shape)
            if local is None:
                local, local_shape = torch.zeros(numel, dtype=torch.float32), shape
            local[lo:hi] = part
        if local is None:
            raise CheckpointError(f"optimizer state of {key} missing from {folder}")
        return local.view(local_shape)

    def full_optim(self, key: str, field: str, spec: ShardSpec) -> torch.Tensor:
        """Full tensor of ``field`` of parameter ``key``: every shard's tensor, unsharded (and stacked)."""
        return self._stack(key, spec, lambda t, e: self.local_optim(key, field, t, e))
