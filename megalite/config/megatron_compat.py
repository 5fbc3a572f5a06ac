"""Megatron-LM flags megalite accepts without a config field, so that Megatron's example launch
scripts run unchanged: each says why it is safe to accept. The ones that change nothing here are
named in one warning at start-up (never silently); docs/training.md lists them all."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

# flag -> (takes a value, why accepting and ignoring it is safe)
IGNORED: dict[str, tuple[bool, str]] = {
    "--use-mcore-models": (False, "megalite has one model implementation"),
    "--transformer-impl": (True, "Transformer Engine is GPU-only; megalite's layers are plain PyTorch"),
    "--fp8-format": (True, "fp8 needs Transformer Engine (GPU-only)"),
    "--fp8-recipe": (True, "fp8 needs Transformer Engine (GPU-only)"),
    "--fp8-margin": (True, "fp8 needs Transformer Engine (GPU-only)"),
    "--fp8-amax-history-len": (True, "fp8 needs Transformer Engine (GPU-only)"),
    "--fp8-amax-compute-algo": (True, "fp8 needs Transformer Engine (GPU-only)"),
    "--fp8-param-gather": (False, "fp8 needs Transformer Engine (GPU-only)"),
    "--tp-comm-overlap": (False, "tunes Transformer Engine's userbuffers (GPU-only)"),
    "--no-gradient-accumulation-fusion": (False, "megalite has no fused weight-gradient kernel to turn off"),
    "--no-masked-softmax-fusion": (False, "megalite has no fused masked-softmax kernel to turn off"),
    "--no-bias-gelu-fusion": (False, "megalite has no fused bias-GeLU kernel to turn off"),
    "--no-bias-swiglu-fusion": (False, "megalite has no fused bias-SwiGLU kernel to turn off"),
    "--no-bias-dropout-fusion": (False, "megalite has no fused bias-dropout kernel to turn off"),
    "--no-rope-fusion": (False, "megalite has no fused RoPE kernel to turn off"),
    "--num-workers": (True, "samples are read from memory-mapped files in the training process, no "
                            "DataLoader workers"),
    "--no-create-attention-mask-in-dataloader": (False, "megalite never builds a dense attention mask: with "
                                                        "--reset-attention-mask the micro-batch carries the "
                                                        "document boundaries (cu_seqlens) instead"),
    "--no-mmap-bin-files": (False, "the .bin files are always memory-mapped"),
    "--ckpt-format": (True, "megalite writes its own sharded format; --load reads Megatron-LM's torch_dist and "
                            "torch folders by their files (docs/checkpoints.md)"),
    "--tiktoken-pattern": (True, "only Megatron-LM's TikTokenizer reads it, and megalite has none"),
}

# flag -> why megalite refuses it (it would change the run, and megalite does not implement it)
REFUSED: dict[str, str] = {
    "--rampup-batch-size": "batch-size ramp-up is not implemented; give a constant --global-batch-size",
    "--step-batch-size-schedule": "batch-size schedules are not implemented; give a constant --global-batch-size",
}

# flag -> why it is honoured although no config field stores it
HONOURED: dict[str, str] = {
    "--log-throughput": "throughput is on the log line by default (--no-log-throughput removes it)",
}

_DEST = "megatron_compat__"


def add_compat_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Megatron-LM compatibility",
                                      "Accepted so Megatron-LM scripts run unchanged (see docs/training.md).")
    for flag, (takes_value, why) in IGNORED.items():
        dest = _DEST + flag.lstrip("-").replace("-", "_")
        kw = dict(dest=dest, default=argparse.SUPPRESS, help=f"Accepted and ignored: {why}.")
        if takes_value:
            group.add_argument(flag, metavar="VALUE", **kw)
        else:
            group.add_argument(flag, action="store_true", **kw)
    for flag, why in REFUSED.items():
        group.add_argument(flag, dest=_DEST + "refused__" + flag.lstrip("-").replace("-", "_"), nargs="*",
                           default=argparse.SUPPRESS, help=f"Refused: {why}.")
    for flag, why in HONOURED.items():
        group.add_argument(flag, dest=_DEST + flag.lstrip("-").replace("-", "_"), action="store_true",
                           default=argparse.SUPPRESS, help=f"Honoured: {why}.")


def pop_compat_flags(ns: dict) -> tuple[list[str], list[str]]:
    """Remove the compatibility flags from parsed values; return the (ignored, refused) ones given."""
    given = [k for k in ns if k.startswith(_DEST)]
    for k in given:
        ns.pop(k)
    ignored = {_DEST + f.lstrip("-").replace("-", "_"): f for f in IGNORED}
    refused = {_DEST + "refused__" + f.lstrip("-").replace("-", "_"): f for f in REFUSED}
    return [ignored[k] for k in given if k in ignored], [refused[k] for k in given if k in refused]


def refusal(flags: Sequence[str]) -> str:
    return "; ".join(f"{f} is a Megatron-LM flag megalite refuses: {REFUSED[f]}" for f in flags)


def warn_ignored(prog: str, flags: Sequence[str]) -> None:
    """One warning naming every accepted-and-ignored flag, printed by rank 0 only."""
    if flags and os.environ.get("RANK", "0") == "0":
        print(f"{prog}: warning: accepted and ignored, no effect in megalite: "
              + "; ".join(f"{f}: {IGNORED[f][1]}" for f in flags), file=sys.stderr, flush=True)
