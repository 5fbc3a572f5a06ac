"""A checkpoint ready for inference, from a command line: flags -> config -> ranks -> model + tokenizer.

The model's shape comes from the checkpoint (``--load``), so a command needs only the tokenizer (or not
even that: the checkpoint names the one it was trained with) and a layout. Megatron-style commands
that repeat the model flags still work: every megalite flag is accepted, and one that contradicts the
checkpoint is refused by name. Inference never uses sequence parallelism, dropout or recomputation
(they change memory or training only, not the function the model computes).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from megalite.checkpointing.load import check_config, load_checkpoint
from megalite.checkpointing.metadata import config_dict
from megalite.checkpointing.reader import CheckpointError, CheckpointReader
from megalite.config.arguments import SECTIONS, MegaliteConfig
from megalite.config.data import DataConfig
from megalite.config.flags import add_dataclass_flags, domain_errors, field_types
from megalite.config.model import ModelConfig
from megalite.config.validate import ConfigError, layout_errors, world_errors
from megalite.config.validate_pipeline import checked_split
from megalite.data.tokenizer import HuggingFaceTokenizer, Tokenizer, build_tokenizer
from megalite.model.build import build_model
from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.random import model_parallel_seed

TOKENIZER_DIR = "tokenizer"  # where from-hf keeps a Hugging Face tokenizer inside a checkpoint
TOKENIZER_FIELDS = ("tokenizer_type", "vocab_size", "vocab_file", "merge_file", "tokenizer_model")


class InferenceParser(argparse.ArgumentParser):
    """Every megalite flag (Megatron names) plus the tool's own; ``parse`` separates the two."""

    def __init__(self, description: str, **kw: Any) -> None:
        super().__init__(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                         allow_abbrev=False, **kw)
        self.tool = self.add_argument_group("this tool")
        self._megalite_dests: set[str] = set()

    def add_megalite_flags(self) -> None:
        before = {a.dest for a in self._actions}
        for klass in SECTIONS.values():
            add_dataclass_flags(self, klass)
        self._megalite_dests = {a.dest for a in self._actions} - before

    def parse(self, argv: Sequence[str] | None) -> tuple[dict[str, Any], argparse.Namespace]:
        """(megalite flags given on the command line, the tool's own flags)."""
        ns = vars(self.parse_args(argv))
        given = {k: ns.pop(k) for k in list(ns) if k in self._megalite_dests}
        return given, argparse.Namespace(**ns)


def inference_parser(description: str) -> InferenceParser:
    parser = InferenceParser(description)
    parser.add_megalite_flags()
    return parser


@dataclass
class InferencePlan:
    """What every rank needs before any process group exists (all of it checked already)."""

    cfg: MegaliteConfig
    load: str
    vocab_size: int  # the model's (true, unpadded) vocabulary
    tokenizer: Tokenizer
    iteration: int


def _tokenizer(given: dict[str, Any], reader: CheckpointReader, load: str) -> Tokenizer:
    """The tokenizer the flags name; else the one the checkpoint was trained with; else the Hugging Face
    tokenizer a from-hf checkpoint holds."""
    if "tokenizer_type" in given:
        source = {k: given.get(k) for k in TOKENIZER_FIELDS}
        where = "the tokenizer flags"
    elif (reader.meta.get("tokenizer") or {}).get("tokenizer_type"):
        source = {k: reader.meta["tokenizer"].get(k) for k in TOKENIZER_FIELDS}
        where = f"the tokenizer recorded in {reader.dir}/metadata.json (override with --tokenizer-type ...)"
    elif os.path.isdir(os.path.join(load, TOKENIZER_DIR)):
        return HuggingFaceTokenizer(os.path.join(load, TOKENIZER_DIR))
    else:
        raise ConfigError(f"--load {load}: the checkpoint names no tokenizer; give --tokenizer-type and its files")
    try:
        return build_tokenizer(DataConfig(**{k: v for k, v in source.items() if v is not None}))
    except (ValueError, OSError) as e:
        raise ConfigError(f"{where}: {e}") from None


def plan(given: dict[str, Any], world_size: int) -> InferencePlan:
    """Check everything (checkpoint, flags against it, layout, tokenizer) before communicating."""
    load = given.get("load")
    if not load:
        raise ConfigError("--load is required: the checkpoint directory to evaluate")
    cp = given.get("context_parallel_size", 1)
    if cp != 1:
        raise ConfigError(f"--context-parallel-size {cp}: context parallelism is not supported in tasks/generation "
                          "(it splits training sequences); use --tensor-model-parallel-size and "
                          "--pipeline-model-parallel-size")
    try:
        reader = CheckpointReader(load)
    except (CheckpointError, OSError, ValueError) as e:
        raise ConfigError(str(e) if str(e).startswith(f"--load {load}") else f"--load {load}: {e}") from None
    saved = reader.config
    if "vocab_size" not in saved:
        raise ConfigError(f"--load {load}: the checkpoint's config has no vocab_size")
    vocab = int(saved["vocab_size"])
    model_fields = field_types(ModelConfig)
    values = {k: v for k, v in saved.items() if k in model_fields}
    values.update(given)  # flags win; check_config below refuses any that change the weights' meaning
    values.update(sequence_parallel=False, recompute_granularity=None, hidden_dropout=0.0, attention_dropout=0.0)
    try:
        cfg = MegaliteConfig.from_flat(values)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None
    if errors := domain_errors(cfg):  # first and alone, as validate() does
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    try:
        check_config(saved, config_dict(cfg.model, vocab), f"--load {load}")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    m, p = cfg.model, cfg.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    errors, split = checked_split(cfg)
    errors += layout_errors(m, tp, pp, p.num_layers_per_virtual_pipeline_stage, split)
    errors += world_errors(world_size, tp, pp, p.context_parallel_size)
    if p.pipeline_schedule == "zbv" and pp > 1:  # the forward pass goes round-robin (inference/pipeline.py)
        errors.append("--pipeline-schedule zbv is a training schedule; tasks and generation place the stages "
                      "round-robin (drop the flag: checkpoints load at any placement)")
    if m.position_embedding_type == "learned_absolute" and m.seq_length > m.max_position_embeddings:
        errors.append(f"--seq-length ({m.seq_length}) must be <= the checkpoint's --max-position-embeddings "
                      f"({m.max_position_embeddings}) with learned absolute positions")
    if cfg.precision.fp16 and cfg.precision.bf16:
        errors.append("--fp16 and --bf16 are exclusive")
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    tokenizer = _tokenizer(given, reader, load)
    if tokenizer.vocab_size > vocab:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but the checkpoint's model only "
                          f"{vocab}: wrong --vocab-file/--tokenizer-model for --load {load}?")
    return InferencePlan(cfg, load, vocab, tokenizer, reader.iteration)


def load_model(plan: InferencePlan, pg: ProcessGroups) -> list[nn.Module]:
    """This rank's model chunks with the checkpoint's weights, in eval mode."""
    cfg = plan.cfg
    tracker = model_parallel_seed(cfg.training.seed, pg.tp_rank, pg.pp_rank)
    chunks = build_model(cfg, pg, plan.vocab_size, tracker, cfg.precision.params_dtype)
    load_checkpoint(plan.load, chunks, None, pg, config_dict(cfg.model, plan.vocab_size), load_optim=False,
                    load_rng=False)
    for c in chunks:
        c.eval()
    return chunks


def last_rank(pg: ProcessGroups) -> bool:
    """The rank that prints (Megatron prints results on the last rank, which is on the last stage)."""
    return pg.rank == pg.layout.world_size - 1


def check_output_file(flag: str, path: str | None) -> None:
    """An output file the tool writes at the end: its folder must exist and not be a file (checked at
    start-up, so a long evaluation is not lost to a typo)."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a directory; give a file name")
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag} {path}: directory {folder} does not exist")


def tokenize_checked(tokenizer: Tokenizer, text: str, vocab_size: int, where: str) -> list[int]:
    """``tokenizer.tokenize(text)``, with text it cannot read, or ids the model has no embedding for,
    refused by name (``where`` says which flag, file or line)."""
    try:
        ids = tokenizer.tokenize(text)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ConfigError(f"{where}: token id {bad[0]} is outside the model's vocabulary [0, {vocab_size})")
    return ids
