"""Checkpoint glue for the training loop: what a run saves besides weights (position in the data,
loss scaler, counters, RNG) and how a run picks up from --load."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megalite import device
from megalite.checkpointing import load_checkpoint, save_checkpoint
from megalite.checkpointing.async_save import AsyncSaver
from megalite.checkpointing.compression_state import compression_files, load_compression
from megalite.checkpointing.megatron.load import load_megatron
from megalite.checkpointing.megatron.read import is_megatron_checkpoint
from megalite.checkpointing.metadata import config_dict
from megalite.checkpointing.paths import TRACKER
from megalite.config.arguments import MegaliteConfig
from megalite.config.data import DOCUMENT_FLAGS
from megalite.config.validate import ConfigError
from megalite.optimizer.optimizer import MegaliteOptimizer
from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.random import RNGTracker


@dataclass
class TrainState:
    iteration: int = 0  # optimizer steps done
    consumed_samples: int = 0
    valid_consumed: int = 0
    skipped_iterations: int = 0
    nan_iterations: int = 0


def rng_states(tracker: RNGTracker) -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state(), "device": device.get_rng_state()}
    states.update({f"tracker/{k}": v for k, v in tracker.get_states().items()})
    return states


def restore_rng(tracker: RNGTracker, states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["cpu"])
    device.set_rng_state(states["device"])
    tracker.set_states({k.split("/", 1)[1]: v for k, v in states.items() if k.startswith("tracker/")})


def maybe_load(cfg: MegaliteConfig, chunks: list[nn.Module], optimizer: MegaliteOptimizer, pg: ProcessGroups,
               tracker: RNGTracker, vocab_size: int, say: Callable[[str], None]) -> TrainState:
    ck = cfg.checkpoint
    if not ck.load:
        return TrainState()
    if ck.load == ck.save and not os.path.isfile(os.path.join(ck.load, TRACKER)):
        say(f" no checkpoint in {ck.load} yet ({TRACKER} absent): starting from iteration 0")
        return TrainState()
    weights_only = ck.finetune or ck.no_load_optim
    if is_megatron_checkpoint(ck.load):  # Megatron-LM's own folder: its weights, read in-process
        load_rng = not (ck.no_load_rng or ck.finetune)
        loaded, rng, rng_note = load_megatron(ck.load, chunks, pg, config_dict(cfg.model, vocab_size),
                                              weights_only=weights_only, optimizer=optimizer,
                                              rng_now=rng_states(tracker) if load_rng else None)
        what = "weights only" if weights_only else "with its Adam state"
        say(f" reading {ck.load} as a Megatron-LM checkpoint ({what}; {rng_note})")
    else:
        loaded, rng = load_checkpoint(ck.load, chunks, optimizer, pg, config_dict(cfg.model, vocab_size),
                                      load_optim=not weights_only, load_rng=not (ck.no_load_rng or ck.finetune))
    if ck.finetune:
        say(f" loaded weights of iteration {loaded.iteration} from {ck.load} for finetuning")
        return TrainState()
    if rng is not None:
        restore_rng(tracker, rng)
    s = loaded.state
    if optimizer.scaler is not None and "loss_scaler" in s and not weights_only:
        optimizer.scaler.load_state_dict(s["loss_scaler"])
    if not weights_only:  # error feedback and PowerSGD's Q (--grad-compression), where the layout allows
        load_compression(ck.load, loaded.iteration, optimizer.buffers, pg, say)
    say(f" loaded checkpoint from {ck.load} at iteration {loaded.iteration}"
        + ("" if loaded.same_layout else " (resharded into this layout)"))
    return TrainState(loaded.iteration, s.get("consumed_samples", 0), s.get("valid_consumed", 0),
                      s.get("skipped_iterations", 0), s.get("nan_iterations", 0))


def check_samples(cfg: MegaliteConfig, ts: TrainState, train: Any, valid: Any) -> None:
    """A resumed run finds every sample it will read, or stops here with one line naming the flags (not a
    traceback at the first batch past the end): the datasets are sized for --train-iters x --global-batch-size,
    and a checkpoint's consumed samples may lie past that (trained at a larger global batch, or further)."""
    t, gbs = cfg.training, cfg.training.global_batch_size
    if ts.iteration == 0 and ts.consumed_samples == 0 and ts.valid_consumed == 0:
        return
    where = (f"--load {cfg.checkpoint.load} (iteration {ts.iteration}, {ts.consumed_samples} training samples "
             f"consumed)")
    left = max(t.train_iters - ts.iteration, 0)
    need = ts.consumed_samples + left * gbs
    if left and train is not None and need > len(train):
        raise ConfigError(f"{where}: the {left} iteration(s) left to --train-iters {t.train_iters} at "
                          f"--global-batch-size {gbs} read up to sample {need}, but the training set holds "
                          f"{len(train)} (sized for --train-iters x --global-batch-size = {t.train_iters * gbs}): "
                          "raise --train-iters, or resume at the global batch size the checkpoint was trained with")
    if valid is None or t.eval_iters <= 0:
        return
    evals = (max(t.train_iters - 1, 0) // t.eval_interval - ts.iteration // t.eval_interval if left else 0) + 1
    need = ts.valid_consumed + max(evals, 1) * t.eval_iters * gbs
    if need > len(valid):
        raise ConfigError(f"{where}: the {evals} evaluation(s) left read up to validation sample {need} "
                          f"(from {ts.valid_consumed} consumed, --eval-iters {t.eval_iters} x --global-batch-size "
                          f"{gbs} each), but the validation set holds {len(valid)}: raise --train-iters, or resume "
                          "at the global batch size the checkpoint was trained with")


def save(cfg: MegaliteConfig, ts: TrainState, chunks: list[nn.Module], optimizer: MegaliteOptimizer,
         pg: ProcessGroups, tracker: RNGTracker, vocab_size: int, say: Callable[[str], None],
         saver: AsyncSaver | None = None) -> None:
    """Save this iteration: at once, or (``saver``, --async-save) started in the background."""
    state = dataclasses.asdict(ts)
    if optimizer.scaler is not None:
        state["loss_scaler"] = optimizer.scaler.state_dict()
    d = cfg.data
    files = {"vocab_file": d.vocab_file, "merge_file": d.merge_file, "tokenizer_model": d.tokenizer_model}
    tokenizer = {"tokenizer_type": d.tokenizer_type, "vocab_size": d.vocab_size,
                 **{k: os.path.abspath(v) if v else None for k, v in files.items()}}
    # the packed-document flags the weights were trained with (a record: tasks and generation score whole texts)
    data = {name: getattr(d, name) for name in DOCUMENT_FLAGS}
    args = (cfg.checkpoint.save, ts.iteration, chunks, optimizer)
    rest = (config_dict(cfg.model, vocab_size), state, rng_states(tracker), {"tokenizer": tokenizer, "data": data},
            compression_files(optimizer.buffers, pg))
    if saver is None:
        say(f" saved checkpoint at iteration {ts.iteration} to {save_checkpoint(*args, pg, *rest)}")
        return
    pending = saver.start(*args, *rest)
    say(f" saving checkpoint at iteration {ts.iteration} in the background (the step stopped "
        f"{pending.stall_s:.3f} s to copy it)")
