"""Reshard a checkpoint without a training run: read it as full tensors, write it at another layout.

``tools/convert_checkpoint.py reshard`` and ``bench/bench_checkpoint.py`` use this; the parts live in
their own modules: the layout rules (config/validate.py), which parameters a layout stores (stored.py),
the full-tensor reader (full_reader.py) and the writer (writer.py), met at the layout-free Full (full.py):
the same path as every conversion.
"""

from __future__ import annotations

import os

from megalite.checkpointing.full_reader import FullCheckpoint
from megalite.checkpointing.metadata import model_config
from megalite.checkpointing.writer import expert_errors, write_full
from megalite.config.validate import layout_errors
from megalite.parallel.placement import LayerSplit


def reshard(load_dir: str, save_dir: str, tp: int, pp: int, layers_per_virtual_stage: int | None = None, *,
            iteration: int | None = None, with_optimizer: bool = True, ep: int = 1, etp: int | None = None,
            split: LayerSplit | None = None) -> str:
    """Write the checkpoint in ``load_dir`` at another (TP, PP, VP, EP, expert-TP) layout into ``save_dir``:
    weights, optimizer state (when saved and ``with_optimizer``), iteration, training state and the
    tokenizer the source was trained with. ``etp`` defaults to ``tp``; ``split``: an uneven or V placement
    of the layers over the ``pp`` stages (default even, round-robin)."""
    if os.path.abspath(save_dir) == os.path.abspath(load_dir):
        raise ValueError(f"--save {save_dir} must differ from --load (a reshard never overwrites its source)")
    src = FullCheckpoint(load_dir, iteration)
    cfg, _ = model_config(src.config)
    etp = tp if etp is None else etp
    errors = layout_errors(cfg, tp, pp, layers_per_virtual_stage, split) + expert_errors(src.config, ep, etp)
    if errors:
        where = f"TP={tp} PP={pp}" + (f" EP={ep} ETP={etp}" if cfg.is_moe else "")
        raise ValueError(f"--load {load_dir} cannot be resharded to {where}:\n  " + "\n  ".join(errors))
    note = {"tool": "convert_checkpoint.py reshard", "source": os.path.abspath(load_dir),
            "source_layout": src.layout}
    return write_full(save_dir, src.full(with_optimizer), tp=tp, pp=pp, ep=ep, etp=etp, note=note, split=split,
                      layers_per_virtual_stage=layers_per_virtual_stage)
