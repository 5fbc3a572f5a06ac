"""load_checkpoint(): restore a checkpoint of any layout into this rank's model chunks and optimizer.

Each parameter is rebuilt full from the saved TP shards and cut for the current layout, so loading
into the saving layout and into any other valid one are the same code path. A model config that
differs from the checkpoint's is refused with every differing flag named.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megalite.checkpointing.metadata import OPTIM_FIELDS, chunk_layer_numbers
from megalite.checkpointing.paths import rng_filename
from megalite.checkpointing.reader import CheckpointError, CheckpointReader
from megalite.checkpointing.stored import named_params, stage_params
from megalite.config.mla import MLA_DEFAULTS
from megalite.config.mtp import MTP_DEFAULTS
from megalite.config.yarn import YARN_DEFAULTS
from megalite.parallel.groups import ProcessGroups
from megalite.parallel.placement import LayerSplit
from megalite.tensor_parallel.param_meta import local_shard, param_meta

# Model fields that change what the weights mean; the rest (dropout, init, padding) may differ.
SHAPE_FIELDS = ["num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "kv_channels", "position_embedding_type", "rotary_base", "rotary_percent", "normalization",
                "swiglu", "untie_embeddings_and_output_weights", "disable_bias_linear", "add_qkv_bias",
                "max_position_embeddings", "vocab_size", "apply_layernorm_1p", "num_experts", "moe_ffn_hidden_size",
                "moe_layer_freq", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
                "moe_router_enable_expert_bias", "use_rope_scaling", "rope_scaling_factor",
                "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
                "rope_scaling_original_max_position_embeddings", "attn_logit_softcapping"]
# Shape fields added after checkpoints without them were written, with the value those checkpoints meant.
LATER_FIELDS = {"apply_layernorm_1p": False, "num_experts": None, "moe_ffn_hidden_size": None, "moe_layer_freq": "1",
                "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False,
                "moe_router_enable_expert_bias": False, "use_rope_scaling": False, "rope_scaling_factor": 8.0,
                "rope_scaling_low_freq_factor": 1.0, "rope_scaling_high_freq_factor": 4.0,
                "rope_scaling_original_max_position_embeddings": 8192, "attn_logit_softcapping": None}
# Gemma's options (--geglu and the rest, config/model.py): older checkpoints meant these values
GEMMA_DEFAULTS = {"geglu": False, "embedding_multiplier": 1.0, "softmax_scale": None, "final_logit_softcapping": None,
                  "rotary_base_local": None, "rotary_seq_len_interpolation_factor": None}
SHAPE_FIELDS += list(GEMMA_DEFAULTS)
LATER_FIELDS.update(GEMMA_DEFAULTS)
SHAPE_FIELDS += list(YARN_DEFAULTS)  # YaRN's options (config/yarn.py): older checkpoints meant their defaults
LATER_FIELDS.update(YARN_DEFAULTS)
SHAPE_FIELDS += list(MLA_DEFAULTS)  # multi-latent attention's (config/mla.py): older checkpoints meant its defaults
LATER_FIELDS.update(MLA_DEFAULTS)
# the norms a layer has (older checkpoints had neither q/k norms nor reordered norms)
NORM_DEFAULTS = {"qk_layernorm": False, "qk_layernorm_scope": "head", "sublayer_norms": "pre"}
SHAPE_FIELDS += list(NORM_DEFAULTS)
LATER_FIELDS.update(NORM_DEFAULTS)
SHAPE_FIELDS.append("mtp_num_layers")  # multi-token prediction's depths (config/mtp.py; its factor is no shape)
LATER_FIELDS["mtp_num_layers"] = MTP_DEFAULTS["mtp_num_layers"]  # older checkpoints had none


class CheckpointMismatch(ValueError):
    """The checkpoint's model differs from the one the flags describe."""


@dataclass
class LoadedState:
    iteration: int
    state: dict[str, Any] = field(default_factory=dict)
    same_layout: bool = True


def shape_diffs(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Each shape field on which a checkpoint's ``saved`` model config and ``current`` differ, as
    '--flag: checkpoint X, flags Y' (fields one side does not record are skipped, except LATER_FIELDS)."""
    saved = {**LATER_FIELDS, **saved}
    return [f"--{k.replace('_', '-')}: checkpoint {saved.get(k)!r}, flags {current.get(k)!r}"
            for k in SHAPE_FIELDS if k in saved and k in current and saved.get(k) != current.get(k)]


def check_config(saved: dict[str, Any], current: dict[str, Any], where: str) -> None:
    diffs = shape_diffs(saved, current)
    if diffs:
        raise CheckpointMismatch(f"{where}: the checkpoint's model differs from the flags:\n  " + "\n  ".join(diffs))


def check_all_read(stored: list[str], model_config: dict[str, Any], where: str) -> None:
    """Every tensor the checkpoint stores is some parameter of the flags' model. The shape fields catch the
    known ways two models differ; a tensor nothing reads (files edited or mixed from two models, a field a
    future version adds) would otherwise be dropped without a word, as ``from-hf`` never allows."""
    wanted = {p.key for stage in stage_params(model_config, 1) for p in stage}
    unread = sorted(set(stored) - wanted)
    if unread:
        more = f" and {len(unread) - 5} more" if len(unread) > 5 else ""
        raise CheckpointMismatch(f"{where}: the checkpoint holds {len(unread)} tensor(s) no parameter of the flags' "
                                 f"model reads ({', '.join(unread[:5])}{more}): its model is not the one the flags "
                                 "describe")


@torch.no_grad()
def load_checkpoint(load_dir: str, chunks: list[nn.Module], optimizer: Any, pg: ProcessGroups,
                    model_config: dict[str, Any], *, load_optim: bool = True, load_rng: bool = True
                    ) -> tuple[LoadedState, dict[str, torch.Tensor] | None]:
    """Load weights (and optimizer state) into this rank's chunks. Returns the saved training state and,
    when the layout is unchanged and ``load_rng``, this rank's RNG states."""
    reader = CheckpointReader(load_dir)
    check_config(reader.config, model_config, f"--load {load_dir}")
    check_all_read(reader.keys(), model_config, f"--load {load_dir}")
    lay = reader.meta["layout"]
    same = (lay["tp"], lay["pp"], lay["dp"], lay.get("cp", 1), lay["vp"], lay["world_size"], reader.ep,
            reader.etp) == (pg.tp_size, pg.pp_size, pg.dp_size, pg.cp_size, len(chunks), pg.layout.world_size,
                            pg.ep_size, pg.etp_size) and _same_layers(lay, chunks, pg, reader.config)
    for _, key, p in named_params(chunks):
        _check_kind(reader, key, p)
        local = _saved_as_is(reader, key, p, pg, reader.local_param)
        if local is None or local.shape != p.shape:
            local = local_shard(param_meta(p), reader.full_param(key, param_meta(p).spec), pg)
        _check_numel(reader, key, local, p.shape)
        p.copy_(local.view(p.shape).to(p.dtype))
    if load_optim and optimizer is not None:
        if not reader.has_optimizer():
            raise CheckpointError(f"--load {load_dir}: the checkpoint has no optimizer state; use --no-load-optim "
                                  "(or --finetune) to load the weights only")
        _load_optimizer(reader, chunks, optimizer, pg)
    rng = None
    if load_rng and same:
        from safetensors.torch import load_file

        path = f"{reader.dir}/{rng_filename(pg.rank)}"
        if os.path.isfile(path):
            reader.verify(path)
        try:
            rng = load_file(path)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"RNG state {path} is missing or corrupt ({e}); use --no-load-rng to skip it"
                                  ) from None
        bad = [k for k in ("cpu", "device") if k not in rng or rng[k].dtype != torch.uint8]
        if bad:
            raise CheckpointError(f"RNG state {path} has no {bad[0]!r} byte tensor; use --no-load-rng to skip it")
    return LoadedState(reader.iteration, dict(reader.state), same), rng


def _same_layers(lay: dict[str, Any], chunks: list[nn.Module], pg: ProcessGroups, config: dict[str, Any]) -> bool:
    """This rank's chunks hold the layers the saving rank's did (an even split and an uneven one, or
    round-robin and a V, place them differently at the same sizes). A checkpoint without ``chunk_layers``
    was saved before uneven splits and V checkpoints existed: an even round-robin split."""
    saved = lay.get("chunk_layers")
    if saved is None:
        saved = [LayerSplit(int(config["num_layers"]), lay["pp"], lay["vp"]).rank_chunks(r) for r in range(lay["pp"])]
    mine = [chunk_layer_numbers(c) for c in chunks]
    return pg.pp_rank < len(saved) and saved[pg.pp_rank] == mine


def _check_numel(reader: CheckpointReader, key: str, got: torch.Tensor, want: torch.Size) -> None:
    """A stored tensor that cannot be this parameter's (its files were edited or mixed from two models)."""
    if got.numel() != want.numel():
        raise CheckpointError(f"checkpoint {reader.dir}: {key} holds {tuple(got.shape)} ({got.numel()} elements) "
                              f"for a parameter of shape {tuple(want)} here")


def _check_kind(reader: CheckpointReader, key: str, p: nn.Parameter) -> None:
    """A parameter is stored in the folders of the family the model declares it in (e.g. a routed
    experts' weight is one in the model, and the other way round)."""
    if reader.has(key) and reader.family(key) != param_meta(p).family:
        raise CheckpointError(f"checkpoint {reader.dir} stores {key} as a {reader.family(key).name} weight, the "
                              f"model as a {param_meta(p).family.name} one")


def _saved_as_is(reader: CheckpointReader, key: str, p: nn.Parameter, pg: ProcessGroups, read) -> torch.Tensor | None:
    """This rank's shard straight from its file (``read(key, shard rank, split rank)``) when the checkpoint was
    cut as this run cuts ``key`` (same sizes of its family's shard and split groups: TP, or expert-TP and EP
    for an expert weight); else None."""
    family = param_meta(p).family
    (cut, size), (block, blocks) = family.coords(pg), family.split_coords(pg)
    if reader.grid(key) != (size, blocks):
        return None
    return read(key, cut, block)


def _load_optimizer(reader: CheckpointReader, chunks: list[nn.Module], optimizer: Any, pg: ProcessGroups) -> None:
    """Each slice this rank's optimizer owns, cut from the saved tensors (read locally when TP is unchanged)."""
    def shard(key: str, field: str, p: nn.Parameter) -> torch.Tensor:
        local = _saved_as_is(reader, key, p, pg, lambda k, t, e: reader.local_optim(k, field, t, e))
        if local is None or local.shape != p.shape:
            local = local_shard(param_meta(p), reader.full_optim(key, field, param_meta(p).spec), pg)
        _check_numel(reader, f"{key}/{field}", local, p.shape)
        return local

    load_optimizer_state(chunks, optimizer, shard, reader.optimizer_step())


def load_optimizer_state(chunks: list[nn.Module], optimizer: Any,
                         shard: Callable[[str, str, nn.Parameter], torch.Tensor], step: float) -> None:
    """The optimizer's slices from ``shard(key, field, param)``, this rank's shard of a saved field (main,
    exp_avg, exp_avg_sq) of a parameter, and Adam's ``step``: what any checkpoint source feeds the optimizer."""
    key_of = {id(p): key for _, key, p in named_params(chunks)}
    slices, _ = optimizer.state_tensors()
    values = [{f: shard(key_of[id(s.param)], f, s.param).reshape(-1)[s.lo:s.hi] for f in OPTIM_FIELDS}
              for s in slices]
    optimizer.load_state_tensors(values, step)
