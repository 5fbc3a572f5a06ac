"""The gradient-compression state in a checkpoint (--grad-compression powersgd|int8): each rank's error
feedback, PowerSGD's warm-started Q matrices and the reductions counted for the warm-up, one file per
global rank (``compression/rank_RRRRR.safetensors``, checksummed like every tensor file).

Why per rank and not resharded: a rank's error is what compression lost of *its own* gradients over the
whole bucket, not a slice of a whole that could be cut for another DP size; so it is restored only into
the layout and gradient buckets it was saved with (Q is identical on all DP ranks but is keyed by those
buckets too). Anything else starts the state afresh with a one-line notice (the warm-up is not run
again). PowerSGD draws no random numbers besides its fixed-seed start, so nothing else is needed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from safetensors import safe_open

from megalite.checkpointing.errors import CheckpointError
from megalite.checkpointing.reader import CheckpointReader
from megalite.checkpointing.save import RankFiles
from megalite.distributed.grad_buffer import GradBuffer
from megalite.parallel.groups import ProcessGroups

FORMAT = "megalite-grad-compression"


def compression_filename(rank: int) -> str:
    return f"compression/rank_{rank:05d}.safetensors"


def _signature(buffers: list[GradBuffer], pg: ProcessGroups) -> dict[str, Any]:
    """What the state is only valid for: the layout and every compressed buffer's buckets."""
    lay = pg.layout
    return {"layout": [lay.dp, lay.tp, lay.pp, lay.cp, pg.ep_size, pg.etp_size, lay.world_size],
            "buckets": {str(i): [[b.start, b.numel] for b in buf.buckets] for i, buf in enumerate(buffers)
                        if buf.compressor is not None}}


def compression_files(buffers: list[GradBuffer], pg: ProcessGroups) -> RankFiles:
    """This rank's compression file for save_checkpoint's ``extra_files`` (none when nothing compresses)."""
    compressed = [(i, b.compressor) for i, b in enumerate(buffers) if b.compressor is not None]
    if not compressed:
        return {}
    tensors, per_buffer = {}, {}
    for i, comp in compressed:
        t, meta = comp.state()
        tensors.update({f"{i}/{k}": v for k, v in t.items()})
        per_buffer[str(i)] = meta
    meta = {**_signature(buffers, pg), "buffers": per_buffer}
    return {compression_filename(pg.rank): (tensors, {"format": FORMAT, "meta": json.dumps(meta)})}


def _read(reader: CheckpointReader, path: str) -> tuple[dict, dict]:
    reader.verify(path)
    try:
        with safe_open(path, framework="pt") as f:
            meta = json.loads((f.metadata() or {})["meta"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        return tensors, {"layout": list(meta["layout"]), "buckets": dict(meta["buckets"]),
                         "buffers": dict(meta["buffers"])}
    except Exception as e:  # noqa: BLE001 - a damaged file is named, whatever the parser raised
        raise CheckpointError(f"gradient-compression state {path} is corrupt ({type(e).__name__}: {e}); "
                              "use --no-load-optim to start the optimizer and compression afresh") from None


def _mismatch(saved: dict, current: dict) -> str | None:
    """Why the saved state does not fit this run, or None."""
    names = ["DP", "TP", "PP", "CP", "EP", "expert-TP", "world size"]
    for name, a, b in zip(names, saved["layout"], current["layout"]):
        if a != b:
            return f"saved at {name} {a}, this run has {name} {b}"
    if saved["buckets"] != current["buckets"]:
        return "the gradient buckets differ (--ddp-bucket-size or the model's parameters changed)"
    return None


def load_compression(load_dir: str, iteration: int, buffers: list[GradBuffer], pg: ProcessGroups,
                     say: Callable[[str], None]) -> None:
    """Restore this rank's compression state from the checkpoint, or start it afresh with a notice
    (printed by the logging rank) when the checkpoint has none or it does not fit this layout."""
    compressed = [(i, b.compressor) for i, b in enumerate(buffers) if b.compressor is not None]
    if not compressed:
        return
    reader = CheckpointReader(load_dir, iteration)
    path = os.path.join(reader.dir, compression_filename(pg.rank))
    if not os.path.isfile(path):
        if os.path.isdir(os.path.join(reader.dir, "compression")):  # saved on fewer ranks
            why = f"saved at world size {reader.meta['layout']['world_size']}"
        else:
            why = "the checkpoint holds none (saved without --grad-compression)"
        return _reset(compressed, iteration, why, say)
    tensors, saved = _read(reader, path)
    why = _mismatch(saved, _signature(buffers, pg))
    if why is None:
        for i, comp in compressed:
            prefix = f"{i}/"
            comp.load_state({k[len(prefix):]: t for k, t in tensors.items() if k.startswith(prefix)},
                            saved["buffers"][str(i)])
        return None
    return _reset(compressed, iteration, why, say)


def _reset(compressed: list, iteration: int, why: str, say: Callable[[str], None]) -> None:
    """Every bucket is reduced once per step, so ``iteration`` reductions are done: no warm-up again."""
    for _, comp in compressed:
        comp.reset(iteration)
    say(f" notice: --grad-compression state (error feedback, PowerSGD Q) starts afresh: {why}; each DP "
        "rank's error is its own, not a shard to cut for another layout")
