"""Offline checkpoint conversion: reshard a megalite checkpoint, export it to Hugging Face, import one.

    # a checkpoint of any layout -> another (TP, PP, VP; EP, expert-TP for MoE) layout, optimizer state included
    python tools/convert_checkpoint.py reshard --load ckpt --save ckpt_tp4 \\
        --tensor-model-parallel-size 4 --pipeline-model-parallel-size 1 [--expert-model-parallel-size 2]

    # -> a transformers folder (config.json + model.safetensors [+ tokenizer]): GPT2LMHeadModel,
    #    LlamaForCausalLM, MixtralForCausalLM or Qwen2MoeForCausalLM, whichever the model is
    python tools/convert_checkpoint.py to-hf --load ckpt --save hf_out \\
        [--tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt]

    # a Megatron-LM checkpoint folder (torch_dist or legacy torch format, any TP/PP) -> a megalite checkpoint
    python tools/convert_checkpoint.py from-megatron --load megatron_ckpt --save ckpt \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1

    # a megalite checkpoint -> Megatron-LM's torch_dist folder (dense GPT/Llama-style models), loadable by
    # megatron-core's dist_checkpointing at any TP; --tensor-model-parallel-size pads the vocabulary as
    # Megatron-LM does for that TP
    python tools/convert_checkpoint.py to-megatron --load ckpt --save megatron_ckpt [--format torch_dist|torch]

    # a local transformers folder (GPT-2, Llama, Mixtral, Qwen2-MoE) -> a megalite checkpoint to continue pretraining
    python tools/convert_checkpoint.py from-hf --load hf_folder --save ckpt \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

Every subcommand is one path: a reader gives the layout-free full checkpoint (megalite/checkpointing/full.py),
a writer writes it. Nothing is downloaded. Every output appears only once complete. See docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import shlex
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megalite.checkpointing import destination  # noqa: E402
from megalite.checkpointing.full import Full  # noqa: E402
from megalite.checkpointing.full_reader import FullCheckpoint  # noqa: E402
from megalite.checkpointing.hf.convert import (  # noqa: E402
    HFConversionError,
    architecture,
    copy_tokenizer_files,
    from_hf_config,
    from_hf_state_dict,
    qkv_bias_only,
    read_hf_config,
    read_hf_weights,
    save_hf_model,
    save_tokenizer,
    to_hf_config,
    to_hf_state_dict,
)
from megalite.checkpointing.hf.moe import moe_tp_errors  # noqa: E402
from megalite.checkpointing.lock import LOCK  # noqa: E402
from megalite.checkpointing.megatron.legacy.writer import save_legacy  # noqa: E402
from megalite.checkpointing.megatron.read import (  # noqa: E402
    checkpoint_format,
    is_megatron_checkpoint,
    iteration_folder,
    read_megatron,
)
from megalite.checkpointing.megatron.torch_dist.writer import save_torch_dist  # noqa: E402
from megalite.checkpointing.metadata import model_config  # noqa: E402
from megalite.checkpointing.paths import TRACKER, iter_dirname  # noqa: E402
from megalite.checkpointing.reader import CheckpointError  # noqa: E402
from megalite.checkpointing.reshard import reshard  # noqa: E402
from megalite.checkpointing.writer import write_full  # noqa: E402
from megalite.config.domain import MAX_COUNT, Domain, domain_option  # noqa: E402
from megalite.config.flags import domain_of  # noqa: E402
from megalite.config.mtp import MTP_DEFAULTS  # noqa: E402
from megalite.config.parallel import ParallelConfig  # noqa: E402
from megalite.config.validate import layout_errors  # noqa: E402
from megalite.config.validate_pipeline import split_flag_errors  # noqa: E402
from megalite.config.yarn import yarn_flags  # noqa: E402
from megalite.data.tokenizer import TOKENIZER_TYPES, build_tokenizer  # noqa: E402
from megalite.parallel.placement import LayerSplit  # noqa: E402

TOKENIZER_FLAGS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOKENIZER_DIR = "tokenizer"  # from-hf keeps the HF tokenizer files here, to-hf exports them again
FLAG_FIELDS = ["num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
               "num_query_groups", "kv_channels", "max_position_embeddings", "position_embedding_type", "rope_type",
               "rotary_base", "normalization", "norm_epsilon", "swiglu", "untie_embeddings_and_output_weights",
               "disable_bias_linear", "add_qkv_bias", "apply_layernorm_1p", "qk_layernorm", "qk_layernorm_scope",
               "sublayer_norms", "window_size", "window_attn_skip_freq", "attn_logit_softcapping", "geglu",
               "embedding_multiplier", "softmax_scale", "final_logit_softcapping", "rotary_base_local",
               "rotary_seq_len_interpolation_factor", "mtp_num_layers", "mtp_loss_scaling_factor"]
# printed only when they differ from this
OMITTED_AT = {"qk_layernorm_scope": "head", "sublayer_norms": "pre", "embedding_multiplier": 1.0,
              "mtp_loss_scaling_factor": MTP_DEFAULTS["mtp_loss_scaling_factor"],
              "moe_router_score_function": "softmax", "moe_router_load_balancing_type": "aux_loss"}
ROPE_SCALING_FLAG_FIELDS = ["use_rope_scaling", "rope_scaling_factor", "rope_scaling_low_freq_factor",
                            "rope_scaling_high_freq_factor", "rope_scaling_original_max_position_embeddings"]
MOE_FLAG_FIELDS = ["num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_layer_freq",
                   "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_router_pre_softmax",
                   "moe_aux_loss_coeff", "moe_router_score_function", "moe_router_enable_expert_bias",
                   "moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor",
                   "moe_router_load_balancing_type"]
MLA_FLAG_FIELDS = ["multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                   "v_head_dim"]

ITERATION = Domain(lo=0, hi=MAX_COUNT)  # a saved iteration (from-hf writes 0)


def model_flags(config: dict) -> str:
    """The pretrain_gpt.py model flags that describe a checkpoint's model."""
    out = []
    for k in (FLAG_FIELDS + (ROPE_SCALING_FLAG_FIELDS if config.get("use_rope_scaling") else [])
              + (MOE_FLAG_FIELDS if config.get("num_experts") else [])
              + (MLA_FLAG_FIELDS if config.get("multi_latent_attention") else [])):
        v = config.get(k)
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            out += [flag] if v else []
        elif isinstance(v, list):  # nargs flags (--window-size LEFT RIGHT)
            out += [flag, *(shlex.quote(str(x)) for x in v)]
        elif v is not None and v != OMITTED_AT.get(k) and not (
                k == "num_query_groups" and not config.get("group_query_attention")):
            out += [flag, shlex.quote(str(v))]
    if config.get("position_embedding_type") == "yarn":
        out += yarn_flags(config)
    return " ".join(out)


def _check_source(load: str, iteration: int | None) -> None:
    """--load is a megalite checkpoint (not a transformers folder) holding --iteration, if one is given."""
    if is_megatron_checkpoint(load):
        raise CheckpointError(f"--load {load} is a Megatron-LM checkpoint; from-megatron imports it at any layout "
                              f"(python tools/convert_checkpoint.py from-megatron --load {load} --save OUT "
                              "--tensor-model-parallel-size T --pipeline-model-parallel-size P)")
    if os.path.isdir(load) and not os.path.isfile(os.path.join(load, TRACKER)) and os.path.isfile(
            os.path.join(load, "config.json")):
        raise CheckpointError(f"--load {load} is a Hugging Face folder, not a megalite checkpoint (no {TRACKER}); "
                              "use the from-hf command to import it")
    if iteration is not None and not os.path.isdir(os.path.join(load, iter_dirname(iteration))):
        held = sorted(int(d[5:]) for d in os.listdir(load) if d.startswith("iter_") and d[5:].isdigit()) \
            if os.path.isdir(load) else []
        raise CheckpointError(f"--iteration {iteration}: --load {load} holds no {iter_dirname(iteration)} (it holds "
                              f"iterations {held or 'none'})")


def _open_checkpoint(load: str, iteration: int | None) -> Full:
    """The weights of a megalite or a Megatron-LM checkpoint as the layout-free Full (full.py) the
    exporters write from."""
    if is_megatron_checkpoint(load):
        return read_megatron(load, iteration).full(with_optimizer=False)
    _check_source(load, iteration)
    return FullCheckpoint(load, iteration).full(with_optimizer=False)


def _check_tokenizer_flags(a: argparse.Namespace) -> None:
    """Tokenizer flags given on the command line must name a readable tokenizer (checked before anything
    is written); only a tokenizer the checkpoint merely records is exported on a best-effort basis."""
    if not a.tokenizer_type and a.vocab_file and a.merge_file:
        a.tokenizer_type = "GPT2BPETokenizer"  # Megatron's default for a vocab and merges pair
    if not a.tokenizer_type:
        for flag in ("vocab_file", "merge_file", "tokenizer_model"):
            if getattr(a, flag):
                raise ValueError(f"--{flag.replace('_', '-')} needs --tokenizer-type (one of "
                                 f"{', '.join(TOKENIZER_TYPES)})")
        return
    if a.tokenizer_type == "NullTokenizer":
        return  # nothing to export
    build_tokenizer(SimpleNamespace(vocab_size=None, **{k: getattr(a, k) for k in TOKENIZER_FLAGS}))


def _say(message: str) -> None:
    print(f"convert_checkpoint.py: {message}", file=sys.stderr, flush=True)


def _refuse_existing(save: str, overwrite: bool) -> None:
    """An output is never written over something that is there unless --overwrite says so (run under the
    claim of ``save``, whose lock file is this writer's own)."""
    held = [n for n in os.listdir(save) if n != LOCK] if os.path.isdir(save) else []
    if held and not overwrite:
        tracker = os.path.join(save, TRACKER)
        what = ""
        if os.path.isfile(tracker):
            with open(tracker, "rb") as f:
                what = f" (it holds a checkpoint at iteration {f.read(32).decode('utf-8', 'replace').strip()})"
        raise CheckpointError(f"--save {save} exists and is not empty{what}; choose a new folder or pass "
                              "--overwrite to replace it")


@contextlib.contextmanager
def _claimed(a: argparse.Namespace, *sources: tuple[str, str | None]) -> Iterator[destination.SaveLock]:
    """--save claimed under the one rule of every checkpoint writer (destination.py): not --load (nor any
    other source) by any path, not inside a live run's folder, its lock held; then not replaced without
    --overwrite."""
    with destination.claim(a.save, [("--load", a.load), *sources], _say, replacing=a.overwrite) as lock:
        _refuse_existing(a.save, a.overwrite)
        yield lock


@contextlib.contextmanager
def _staged_output(a: argparse.Namespace, lock: destination.SaveLock) -> Iterator[str]:
    """A per-process staging folder that replaces --save as a whole only once complete; removed on failure
    (so a failed or interrupted write leaves --save as it was and nothing partial)."""
    with destination.replacing(a.save, lock, _say) as staged:
        yield staged


SPLIT_FLAGS = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
               "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
               "num_virtual_stages_per_pipeline_rank", "pipeline_model_parallel_layout", "pipeline_schedule")


def target_split(a: argparse.Namespace, num_layers: int) -> LayerSplit | None:
    """The layer placement the target layout's split flags name (pretrain_gpt.py's meaning); None: the even
    round-robin one of --num-layers-per-virtual-pipeline-stage. A broken rule is a ValueError naming it."""
    given = {k: getattr(a, k) for k in SPLIT_FLAGS if getattr(a, k) not in (None, False, "1f1b")}
    if not given:
        return None
    p = ParallelConfig(pipeline_model_parallel_size=a.pipeline_model_parallel_size,
                       num_layers_per_virtual_pipeline_stage=a.num_layers_per_virtual_pipeline_stage, **given)
    errors = split_flag_errors(p)
    if errors:
        raise ValueError("; ".join(errors))
    return p.layer_split(num_layers)


def cmd_reshard(a: argparse.Namespace) -> None:
    _check_source(a.load, a.iteration)
    split = target_split(a, int(FullCheckpoint(a.load, a.iteration).config.get("num_layers", 0)))
    with _claimed(a) as lock:
        with _staged_output(a, lock) as staged:
            path = reshard(a.load, staged, a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
                           a.num_layers_per_virtual_pipeline_stage, iteration=a.iteration,
                           with_optimizer=not a.no_optim, ep=a.expert_model_parallel_size,
                           etp=a.expert_tensor_parallel_size, split=split)
            copy_tokenizer_files(os.path.join(a.load, TOKENIZER_DIR), os.path.join(staged, TOKENIZER_DIR))
    path = os.path.join(a.save, os.path.basename(path))
    experts = (f" EP={a.expert_model_parallel_size}" if a.expert_model_parallel_size > 1 else "") + (
        f" ETP={a.expert_tensor_parallel_size}" if a.expert_tensor_parallel_size is not None else "")
    print(f"wrote {path} (TP={a.tensor_model_parallel_size} PP={a.pipeline_model_parallel_size}{experts}"
          + (f" VP layers={a.num_layers_per_virtual_pipeline_stage}" if a.num_layers_per_virtual_pipeline_stage
             else "") + ")")


def _tokenizer_source(a: argparse.Namespace, ckpt: Full) -> dict | None:
    """Tokenizer flags given here, else one the checkpoint names (metadata) or holds (from-hf)."""
    if a.tokenizer_type:
        return {"tokenizer_type": a.tokenizer_type, "vocab_file": a.vocab_file, "merge_file": a.merge_file,
                "tokenizer_model": a.tokenizer_model}
    named = ckpt.tokenizer
    if named and named.get("tokenizer_type"):
        return named
    held = os.path.join(a.load, TOKENIZER_DIR)
    if os.path.isdir(held):
        return {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": held}
    return None


def cmd_to_hf(a: argparse.Namespace) -> None:
    ckpt = _open_checkpoint(a.load, a.iteration)
    cfg, _ = model_config(ckpt.config)
    architecture(cfg)  # fail before reading any tensor
    _check_tokenizer_flags(a)
    tok = _tokenizer_source(a, ckpt)
    read = [(f"--{k.replace('_', '-')}" if a.tokenizer_type else f"--load's recorded tokenizer ({k})",
             (tok or {}).get(k)) for k in ("vocab_file", "merge_file", "tokenizer_model")]
    with _claimed(a, *read) as lock, _staged_output(a, lock) as staged:
        os.makedirs(staged)
        eod = None
        if tok:
            try:
                eod = save_tokenizer(staged, max_length=cfg.max_position_embeddings, **{
                    k: tok.get(k) for k in ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")})
            except Exception as e:  # noqa: BLE001 - best effort for a recorded tokenizer: the model is what matters
                if a.tokenizer_type or (isinstance(e, OSError) and e.errno in destination.WRITE_ERRNOS):
                    raise  # flags were checked above, a full disk is no tokenizer's fault: not theirs to hide
                print(f"warning: tokenizer not exported ({type(e).__name__}: {e})", file=sys.stderr)
        dtype = DTYPES[a.dtype] if a.dtype else None
        hf_config = to_hf_config(ckpt.config, eod)
        save_hf_model(staged, hf_config, to_hf_state_dict(ckpt.config, ckpt.param, dtype))
    print(f"wrote {a.save}: {hf_config.architectures[0]} from iteration "
          f"{ckpt.iteration} of {a.load} (saved at TP={ckpt.layout['tp']} PP={ckpt.layout['pp']})"
          + (", with tokenizer" if os.path.isfile(os.path.join(a.save, "tokenizer_config.json")) else ""))


def _hf_config_dict(hf_config, where: str, qkv_only: bool, layernorm_1p: bool) -> dict:
    """from_hf_config(), a value of the wrong type (a string for a size, a missing key) named instead of
    escaping as a traceback."""
    try:
        return from_hf_config(hf_config, where, qkv_bias_only=qkv_only, apply_layernorm_1p=layernorm_1p)
    except (TypeError, AttributeError, KeyError, ArithmeticError) as e:
        raise HFConversionError(f"{where}: a value is missing or of the wrong type ({type(e).__name__}: {e})"
                                ) from None


def cmd_from_hf(a: argparse.Namespace) -> None:
    if os.path.isfile(os.path.join(a.load, TRACKER)):
        raise HFConversionError(f"--load {a.load} is a megalite checkpoint; from-hf reads a transformers folder")
    # every check of the source (its config, the cut) before --save is claimed or any weight is read
    where = os.path.join(a.load, "config.json")
    hf_config = read_hf_config(a.load)
    config = _hf_config_dict(hf_config, where, True, a.apply_layernorm_1p)
    cfg = model_config(config)[0]
    split = target_split(a, cfg.num_layers)
    errors = layout_errors(cfg, a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
                           a.num_layers_per_virtual_pipeline_stage, split)
    errors += moe_tp_errors(cfg, a.tensor_model_parallel_size)
    if errors:
        raise ValueError(f"{where}: this model cannot be cut into TP={a.tensor_model_parallel_size} "
                         f"PP={a.pipeline_model_parallel_size}:\n  " + "\n  ".join(errors))
    with _claimed(a) as lock:
        _from_hf_into(a, lock, hf_config, split)


def _from_hf_into(a: argparse.Namespace, lock: destination.SaveLock, hf_config: Any, split: Any) -> None:
    """from-hf's work once the source is checked and --save is claimed."""
    where = os.path.join(a.load, "config.json")
    sd = read_hf_weights(a.load, hf_config)
    config = _hf_config_dict(hf_config, where, qkv_bias_only(hf_config, sd), a.apply_layernorm_1p)
    params = from_hf_state_dict(config, sd)
    dtype = DTYPES[a.dtype] if a.dtype else None
    note = {"tool": "convert_checkpoint.py from-hf", "source": os.path.abspath(a.load),
            "architecture": type(hf_config).__name__}
    with _staged_output(a, lock) as staged:
        path = write_full(staged, Full(config, params.__getitem__, source="hf"), tp=a.tensor_model_parallel_size,
                          pp=a.pipeline_model_parallel_size, note=note, dtype=dtype,
                          layers_per_virtual_stage=a.num_layers_per_virtual_pipeline_stage,
                          ep=a.expert_model_parallel_size, etp=a.expert_tensor_parallel_size, split=split)
        tok = copy_tokenizer_files(a.load, os.path.join(staged, TOKENIZER_DIR))
    path = os.path.join(a.save, os.path.basename(path))
    print(f"wrote {path} (TP={a.tensor_model_parallel_size} PP={a.pipeline_model_parallel_size}, "
          f"vocab {config['vocab_size']}). Continue pretraining with:\n  --load {a.save} --finetune "
          f"{model_flags(config)}"
          + (" --sequence-parallel" if config.get("num_experts") and a.tensor_model_parallel_size > 1 else "")
          + (f" --tokenizer-type HuggingFaceTokenizer --tokenizer-model {os.path.join(a.save, TOKENIZER_DIR)}"
             if tok else ""))


def cmd_from_megatron(a: argparse.Namespace) -> None:
    folder, _ = iteration_folder(a.load, a.iteration)  # a missing or unreadable tracker named as such
    if checkpoint_format(folder) is None:
        raise CheckpointError(f"--load {a.load}: {folder} is not a Megatron-LM checkpoint (neither .metadata + "
                              "common.pt nor mp_rank_*/model_optim_rng.pt)")
    with _claimed(a) as lock:
        _from_megatron_into(a, lock)


def _from_megatron_into(a: argparse.Namespace, lock: destination.SaveLock) -> None:
    """from-megatron's work once --save is claimed."""
    src = read_megatron(a.load, a.iteration, a.vocab_size)
    cfg = model_config(src.config)[0]
    tp, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    split = target_split(a, cfg.num_layers)
    errors = layout_errors(cfg, tp, pp, a.num_layers_per_virtual_pipeline_stage, split) + moe_tp_errors(cfg, tp)
    if errors:
        raise ValueError(f"--load {a.load}: this model cannot be cut into TP={tp} PP={pp}:\n  " + "\n  ".join(errors))
    full = src.full(with_optimizer=not a.no_load_optim)
    optimizer = full.optimizer
    note = {"tool": "convert_checkpoint.py from-megatron", "source": os.path.abspath(a.load),
            "format": src.format, "weights_only": optimizer is None}
    with _staged_output(a, lock) as staged:
        path = write_full(staged, full, tp=tp, pp=pp, note=note, split=split,
                          layers_per_virtual_stage=a.num_layers_per_virtual_pipeline_stage,
                          ep=a.expert_model_parallel_size, etp=a.expert_tensor_parallel_size,
                          dtype=DTYPES[a.dtype] if a.dtype else None)
    path = os.path.join(a.save, os.path.basename(path))
    what = src.optimizer_note if optimizer else "weights only" + ("" if a.no_load_optim else f"; {src.optimizer_note}")
    print(f"wrote {path} (TP={tp} PP={pp}, {src.format} checkpoint of iteration {src.iteration}, vocab "
          f"{src.config['vocab_size']}; {what}). Continue with:\n  --load {a.save}"
          f"{' --no-load-optim' if optimizer is None else ''} {model_flags(src.config)}")


def _add_from_megatron(sub, layout) -> None:
    """The from-megatron subcommand (``layout`` adds the output layout flags)."""
    m = sub.add_parser("from-megatron", help="import a Megatron-LM checkpoint (torch_dist or legacy torch format)")
    m.add_argument("--load", required=True, help="Megatron-LM checkpoint directory (holding "
                   "latest_checkpointed_iteration.txt)")
    m.add_argument("--save", required=True, help="output checkpoint directory")
    domain_option(m, "--iteration", domain=ITERATION, integer=True, default=None,
                  help="iteration to read (default: the tracker's)")
    domain_option(m, "--vocab-size", domain=Domain(lo=1, hi=MAX_COUNT), integer=True, default=None,
                  help="true vocabulary size: drop Megatron's padding rows (default: args.vocab_size, else all rows)")
    m.add_argument("--dtype", choices=list(DTYPES), default=None, help="cast weights (default: as stored)")
    m.add_argument("--no-load-optim", action="store_true", help="leave the Adam state out (by default it is "
                   "imported when the checkpoint holds it in torch_dist's model-space layout)")
    m.add_argument("--overwrite", action="store_true", help="replace a non-empty --save folder")
    layout(m)
    m.set_defaults(func=cmd_from_megatron)


def cmd_to_megatron(a: argparse.Namespace) -> None:
    for flag in ("pipeline_model_parallel_size", "expert_model_parallel_size"):
        if a.format == "torch_dist" and getattr(a, flag) != 1:
            raise ValueError(f"--{flag.replace('_', '-')}: a torch_dist export holds whole tensors and loads at "
                             "any layout; the flag is for --format torch")
    ckpt = FullCheckpoint(a.load, a.iteration).full(with_optimizer=False)
    tp, pp, ep = a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.expert_model_parallel_size
    dtype = DTYPES[a.dtype] if a.dtype else None
    with _claimed(a) as lock, _staged_output(a, lock) as staged:
        os.makedirs(staged)
        if a.format == "torch_dist":
            it_dir = save_torch_dist(staged, ckpt.config, ckpt.param, ckpt.iteration, tp_hint=tp,
                                     padded_vocab=a.padded_vocab_size, dtype=dtype)
        else:
            it_dir = save_legacy(staged, ckpt.config, ckpt.param, ckpt.iteration, tp=tp, pp=pp, ep=ep,
                                 padded_vocab=a.padded_vocab_size, dtype=dtype)
    layout = "" if a.format == "torch_dist" else (f" --tensor-model-parallel-size {tp} --pipeline-model-parallel-size"
                                                  f" {pp}" + (f" --expert-model-parallel-size {ep}" if ep > 1 else ""))
    print(f"wrote {os.path.join(a.save, os.path.basename(it_dir))} ({a.format}, iteration {ckpt.iteration} of "
          f"{a.load}; weights only). Load it in Megatron-LM with --ckpt-format {a.format} --load {a.save}{layout} "
          "--no-load-optim --no-load-rng")


def _add_to_megatron(sub) -> None:
    """The to-megatron subcommand."""
    t = sub.add_parser("to-megatron", help="export to a Megatron-LM checkpoint, torch_dist or legacy torch "
                       "(dense and MoE models)")
    t.add_argument("--load", required=True, help="checkpoint directory")
    t.add_argument("--save", required=True, help="output Megatron-LM checkpoint directory")
    domain_option(t, "--iteration", domain=ITERATION, integer=True, default=None,
                  help="iteration to read (default: the tracker's)")
    t.add_argument("--format", choices=["torch_dist", "torch"], default="torch_dist",
                   help="Megatron-LM checkpoint format: torch_dist (loads at any layout) or the legacy torch "
                   "format (one file per TP x PP rank, loaded at that layout)")
    domain_option(t, "--tensor-model-parallel-size", domain=Domain(lo=1, hi=MAX_COUNT), integer=True, default=1,
                  help="the TP Megatron-LM will load at: the vocabulary is padded as it pads it (--format "
                  "torch: the TP the files are cut for)")
    domain_option(t, "--pipeline-model-parallel-size", domain=Domain(lo=1, hi=MAX_COUNT), integer=True, default=1,
                  help="--format torch: the pipeline stages the files are cut for (layers split evenly)")
    domain_option(t, "--expert-model-parallel-size", domain=Domain(lo=1, hi=MAX_COUNT), integer=True, default=1,
                  help="--format torch: the expert-parallel ranks the routed experts are cut for")
    domain_option(t, "--padded-vocab-size", domain=Domain(lo=1, hi=MAX_COUNT), integer=True, default=None,
                  help="embedding rows to write (default: Megatron-LM's padding for the TP above)")
    t.add_argument("--dtype", choices=list(DTYPES), default=None, help="cast weights (default: as saved)")
    t.add_argument("--overwrite", action="store_true", help="replace a non-empty --save folder")
    t.set_defaults(func=cmd_to_megatron)


def layout(sp: argparse.ArgumentParser) -> None:
    """The layout flags of a written checkpoint, as pretrain_gpt.py spells them."""
    def flag(name: str, default: int | None, help: str = "") -> None:
        """The same value as pretrain_gpt.py's flag of that name: the same declared domain."""
        domain, integer = domain_of(ParallelConfig, name)
        domain_option(sp, "--" + name.replace("_", "-"), domain=domain, integer=integer, default=default,
                      help=help)

    flag("tensor_model_parallel_size", 1)
    flag("pipeline_model_parallel_size", 1)
    flag("num_layers_per_virtual_pipeline_stage", None)
    flag("expert_model_parallel_size", 1, help="MoE models: EP ranks the routed experts are split over")
    flag("expert_tensor_parallel_size", None,
         help="MoE models: expert-TP ranks each routed expert is cut over (default: TP)")
    flag("num_virtual_stages_per_pipeline_rank", None, help="model chunks per rank (Megatron-LM's flag)")
    flag("decoder_first_pipeline_num_layers", None, help="layers of the first stage (pretrain_gpt.py's flag)")
    flag("decoder_last_pipeline_num_layers", None, help="layers of the last stage (pretrain_gpt.py's flag)")
    sp.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                    help="the embedding counts as a layer of the split")
    sp.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                    help="the loss counts as a layer of the split")
    sp.add_argument("--pipeline-model-parallel-layout", default=None, help="every stage's layers (E|t*3|tL)")
    sp.add_argument("--pipeline-schedule", choices=["1f1b", "zbv"], default="1f1b",
                    help="zbv: the two chunks per rank placed in ZB-V's V (the run's --pipeline-schedule)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("reshard", help="write a checkpoint at another TP/PP/VP/EP layout (optimizer state included)")
    r.add_argument("--load", required=True, help="checkpoint directory (holding latest_checkpointed_iteration.txt)")
    r.add_argument("--save", required=True, help="output checkpoint directory (not --load)")
    domain_option(r, "--iteration", domain=ITERATION, integer=True, default=None,
                  help="iteration to read (default: the tracker's)")
    r.add_argument("--no-optim", action="store_true", help="weights only")
    r.add_argument("--overwrite", action="store_true", help="replace a non-empty --save folder")
    layout(r)
    r.set_defaults(func=cmd_reshard)

    t = sub.add_parser("to-hf", help="export to a transformers folder (GPT2LMHeadModel, LlamaForCausalLM, "
                       "MixtralForCausalLM or Qwen2MoeForCausalLM)")
    t.add_argument("--load", required=True, help="checkpoint directory")
    t.add_argument("--save", required=True, help="output transformers folder")
    domain_option(t, "--iteration", domain=ITERATION, integer=True, default=None,
                  help="iteration to read (default: the tracker's)")
    t.add_argument("--dtype", choices=list(DTYPES), default=None, help="cast weights (default: as saved)")
    t.add_argument("--overwrite", action="store_true", help="replace a non-empty --save folder")
    t.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES,
                   help="tokenizer to export (megalite's --tokenizer-type)")
    t.add_argument("--vocab-file", default=None)
    t.add_argument("--merge-file", default=None)
    t.add_argument("--tokenizer-model", default=None)
    t.set_defaults(func=cmd_to_hf)

    f = sub.add_parser("from-hf", help="import a local transformers folder (GPT-2, Llama, Mixtral or Qwen2-MoE)")
    f.add_argument("--load", required=True, help="transformers folder (config.json + weights)")
    f.add_argument("--save", required=True, help="output checkpoint directory")
    f.add_argument("--dtype", choices=list(DTYPES), default=None, help="cast weights (default: as stored)")
    f.add_argument("--overwrite", action="store_true", help="replace a non-empty --save folder")
    f.add_argument("--apply-layernorm-1p", action="store_true",
                   help="store zero-centred norm weights (HF's weight - 1), for training with --apply-layernorm-1p")
    layout(f)
    f.set_defaults(func=cmd_from_hf)

    _add_from_megatron(sub, layout)
    _add_to_megatron(sub)
    return p


def _os_error(e: OSError) -> str:
    """An OSError as one line: the path(s) and the system's reason."""
    if e.strerror is None:
        return str(e)  # raised with a message of its own
    paths = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
    return f"{paths}: {e.strerror}" if paths else f"{e.strerror} ({errno.errorcode.get(e.errno, e.errno)})"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except KeyboardInterrupt:
        done = os.path.abspath(args.save) in destination.COMMITTED
        print(f"convert_checkpoint.py {args.command}: interrupted; "
              + (f"{args.save} was complete and is in place" if done else "nothing written"), file=sys.stderr)
        return 130
    except OSError as e:
        print(f"convert_checkpoint.py {args.command}: error: {_os_error(e)}", file=sys.stderr)
        return 2
    except (CheckpointError, HFConversionError, ValueError) as e:
        print(f"convert_checkpoint.py {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
