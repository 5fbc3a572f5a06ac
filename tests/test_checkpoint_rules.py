"""Promises of the rules both checkpoint formats share (megalite's own and Megatron-LM's folders):
- one strict tracker reader (paths.read_tracker): whatever a tracker holds that is not an iteration number
  (or, in a Megatron-LM folder, ``release``) — undecodable bytes, a digit only ``str.isdigit`` takes, a
  directory of that name — is a CheckpointError naming the file, from every reader and from the probe that
  tells a Megatron-LM folder from a megalite one (which runs before the reader);
- one iteration-folder rule: a checkpoint's recorded iteration (metadata.json's, or the iteration
  Megatron-LM's common.pt / model_optim_rng.pt records) equals its folder's and the tracker's, else a
  CheckpointError naming both."""

from __future__ import annotations

import os

import pytest
import torch

from megalite.checkpointing.errors import CheckpointError
from megalite.checkpointing.full_reader import FullCheckpoint
from megalite.checkpointing.megatron.legacy.writer import save_legacy
from megalite.checkpointing.megatron.read import is_megatron_checkpoint, iteration_folder, read_megatron
from megalite.checkpointing.megatron.torch_dist.writer import save_torch_dist
from megalite.checkpointing.metadata import config_dict
from megalite.checkpointing.paths import TRACKER, iter_dirname, read_tracker
from megalite.checkpointing.reader import CheckpointReader
from megalite.checkpointing.stored import named_params
from megalite.checkpointing.writer import write_checkpoint
from megalite.config.model import ModelConfig
from megalite.model.gpt import GPTModel
from megalite.parallel.groups import ProcessGroups
from megalite.parallel.layout import RankLayout
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.param_meta import param_meta
from megalite.tensor_parallel.random import RNGTracker

VOCAB = 64
FLAGS = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, max_position_embeddings=16,
             hidden_dropout=0.0, attention_dropout=0.0)
# Tracker contents that are not an iteration number, each of which tripped a reader before the rule.
BAD_TRACKERS = {
    "undecodable": b"\xff\xfe7",
    "superscript-digit": "\u00b2".encode(),  # str.isdigit() says yes, int() says no
    "arabic-indic-digit": "\u0661".encode(),  # str.isdigit() and int() both say yes
    "spaces-inside": b"1 0",
    "signed": b"-3",
}


@pytest.fixture(scope="module")
def full() -> tuple[dict, dict[str, torch.Tensor]]:
    """A tiny GPT's checkpoint config and full tensors."""
    cfg = ModelConfig(**FLAGS)
    tracker = RNGTracker()
    tracker.add("model-parallel-rng", 7)
    model = GPTModel(cfg, BuildContext(ProcessGroups.unconnected(RankLayout(1, 1, 1), 0), tracker), VOCAB)
    return config_dict(cfg, VOCAB), {k: param_meta(p).spec.unshard([p.detach()]) for _, k, p in named_params([model])}


def _megalite(root, full, iteration: int = 3) -> str:
    path = str(root / "megalite")
    write_checkpoint(path, full[0], full[1].__getitem__, tp=1, pp=1, iteration=iteration)
    return path


def _megatron(root, full, fmt: str, iteration: int = 3) -> str:
    path = str(root / fmt)
    os.makedirs(path)
    if fmt == "torch_dist":
        save_torch_dist(path, full[0], full[1].__getitem__, iteration)
    else:
        save_legacy(path, full[0], full[1].__getitem__, iteration, tp=1, pp=1)
    return path


def _track(path: str, raw: bytes | None) -> None:
    """Point ``path``'s tracker at ``raw`` (None: replace the tracker by a directory of its name)."""
    tracker = os.path.join(path, TRACKER)
    os.remove(tracker)
    if raw is None:
        os.makedirs(tracker)
        return
    with open(tracker, "wb") as f:
        f.write(raw)


@pytest.mark.parametrize("bad", [*BAD_TRACKERS, "directory"])
@pytest.mark.parametrize("fmt", ["megalite", "torch_dist", "torch"])
def test_a_bad_tracker_is_one_named_error_in_every_reader(full, tmp_path, fmt, bad):
    """The Megatron-LM probe (which --load and the converter run first) says 'not Megatron-LM' instead of a
    traceback, and every reader of either format raises CheckpointError naming the tracker."""
    path = _megalite(tmp_path, full) if fmt == "megalite" else _megatron(tmp_path, full, fmt)
    _track(path, BAD_TRACKERS.get(bad))
    assert is_megatron_checkpoint(path) is False
    readers = [read_tracker, CheckpointReader, FullCheckpoint, read_megatron, iteration_folder]
    for read in readers:
        with pytest.raises(CheckpointError, match=TRACKER) as e:
            read(path)
        assert str(e.value).count("\n") == 0, (read.__name__, str(e.value))


def test_release_is_a_megatron_tracker_word_only(full, tmp_path):
    """``release`` names Megatron-LM's release/ folder (iteration 0 there); megalite's own reader refuses it."""
    path = _megatron(tmp_path, full, "torch_dist")
    os.rename(os.path.join(path, iter_dirname(3)), os.path.join(path, "release"))
    _track(path, b"release")
    assert is_megatron_checkpoint(path)
    assert iteration_folder(path) == (os.path.join(path, "release"), 0)
    with pytest.raises(CheckpointError, match="holds 'release', expected an iteration number"):
        read_tracker(path)


def _renamed(path: str, old: int, new: int) -> None:
    """Move iteration ``old``'s folder to iteration ``new``'s name and point the tracker there."""
    os.rename(os.path.join(path, iter_dirname(old)), os.path.join(path, iter_dirname(new)))
    _track(path, str(new).encode())


@pytest.mark.parametrize("fmt", ["megalite", "torch_dist", "torch"])
def test_a_folder_renamed_to_another_iteration_is_refused(full, tmp_path, fmt):
    """A checkpoint saved at iteration 3 under iter_0000005 (the tracker saying 5, or --iteration 5) would
    resume at the wrong step and data position: refused, naming both iterations."""
    path = _megalite(tmp_path, full) if fmt == "megalite" else _megatron(tmp_path, full, fmt)
    _renamed(path, 3, 5)
    readers = [CheckpointReader, FullCheckpoint] if fmt == "megalite" else [read_megatron]
    for read in readers:
        for iteration in (None, 5):
            with pytest.raises(CheckpointError, match=r"is 3, but the checkpoint's folder is iter_0000005"):
                read(path, iteration)


@pytest.mark.parametrize("fmt", ["megalite", "torch_dist", "torch"])
def test_a_checkpoint_at_its_own_iteration_reads(full, tmp_path, fmt):
    """The rule refuses only a mismatch: the same checkpoint under its own name reads, at its iteration."""
    path = _megalite(tmp_path, full) if fmt == "megalite" else _megatron(tmp_path, full, fmt)
    got = FullCheckpoint(path) if fmt == "megalite" else read_megatron(path)
    assert got.iteration == 3


def test_the_layers_norms_are_shape_fields():
    """A checkpoint saved with q/k norms or reordered norms (--qk-layernorm, its scope, --sublayer-norms) does
    not load into flags without them (their weights would be left unread, and MLA's latent norms too); one
    saved before the fields meant neither."""
    from megalite.checkpointing.load import shape_diffs
    from megalite.checkpointing.metadata import config_dict
    from megalite.config.model import ModelConfig

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, normalization="RMSNorm")
    plain = config_dict(ModelConfig(**base), 64)
    for extra, flag in ((dict(qk_layernorm=True), "--qk-layernorm"),
                        (dict(qk_layernorm=True, qk_layernorm_scope="projection"), "--qk-layernorm-scope"),
                        (dict(sublayer_norms="pre-post"), "--sublayer-norms")):
        saved = config_dict(ModelConfig(**base, **extra), 64)
        assert any(d.startswith(flag + ":") for d in shape_diffs(saved, plain)), extra
    older = {k: v for k, v in plain.items() if k not in ("qk_layernorm", "qk_layernorm_scope", "sublayer_norms")}
    assert shape_diffs(older, plain) == []


def test_a_stored_tensor_no_parameter_reads_is_refused_by_name(tmp_path):
    """A checkpoint whose files hold a tensor the flags' model has no parameter for (here q/k norms, saved
    with --qk-layernorm, in a metadata.json that no longer records the field, as a checkpoint from before a
    shape field existed) is refused naming the tensor, not loaded with those weights dropped."""
    import json

    from megalite.checkpointing.load import CheckpointMismatch, load_checkpoint

    def tiny(**extra) -> tuple[GPTModel, dict]:
        cfg = ModelConfig(**FLAGS, normalization="RMSNorm", **extra)
        tracker = RNGTracker()
        tracker.add("model-parallel-rng", 7)
        return GPTModel(cfg, BuildContext(ProcessGroups.unconnected(RankLayout(1, 1, 1), 0), tracker), VOCAB), \
            config_dict(cfg, VOCAB)

    normed, config = tiny(qk_layernorm=True)
    tensors = {k: p.detach() for _, k, p in named_params([normed])}
    path = str(tmp_path / "ck")
    write_checkpoint(path, config, tensors.__getitem__, tp=1, pp=1, iteration=3)
    meta_path = os.path.join(path, iter_dirname(3), "metadata.json")
    with open(meta_path) as f:
        meta = json.load(f)
    for k in ("qk_layernorm", "qk_layernorm_scope", "sublayer_norms"):
        meta["config"].pop(k)
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    plain, plain_config = tiny()
    pg = ProcessGroups.unconnected(RankLayout(1, 1, 1), 0)
    with pytest.raises(CheckpointMismatch, match=r"tensor\(s\) no parameter of the flags' model reads "
                                                 r"\(layers\.0\.attention\.k_norm\.weight, "):
        load_checkpoint(path, [plain], None, pg, plain_config, load_optim=False, load_rng=False)


def test_a_file_saved_without_a_checksum_is_not_listed_and_reads(full, tmp_path, monkeypatch):
    """A save whose checksums were not taken (bench/bench_checkpoint.py's run without the CRC) lists none, so
    the strict metadata reader (which refuses a listed checksum that is not a string) reads it."""
    from megalite.checkpointing import metadata

    monkeypatch.setattr(metadata, "file_checksum", lambda path: None)
    path = _megalite(tmp_path, full)
    reader = CheckpointReader(path)
    assert reader.checksums == {} and reader.iteration == 3
