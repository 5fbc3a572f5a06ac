"""Metric sinks beside stdout: TensorBoard (--tensorboard-dir) and Weights & Biases (--wandb-project).

Both are imported lazily, only when asked for; W&B runs offline when no API key is configured, so a
run never needs the network. Only the rank that prints the log line writes.
"""

from __future__ import annotations

import os
from typing import Any

from megalite.config.training import LoggingConfig


class MetricWriters:
    def __init__(self, cfg: LoggingConfig, enabled: bool, run_config: dict[str, Any]) -> None:
        self.tb = self.wandb = None
        if not enabled:
            return
        if cfg.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise RuntimeError("--tensorboard-dir needs the tensorboard package (pip install tensorboard)") from e
            self.tb = SummaryWriter(log_dir=cfg.tensorboard_dir, max_queue=cfg.tensorboard_queue_size)
        if cfg.wandb_project:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError("--wandb-project needs the wandb package (pip install wandb)") from e
            mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
            self.wandb = wandb.init(project=cfg.wandb_project, name=cfg.wandb_exp_name, dir=cfg.wandb_save_dir,
                                    config=run_config, mode=mode)

    def scalars(self, values: dict[str, float | None], step: int) -> None:
        values = {k: v for k, v in values.items() if v is not None}
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
