"""The chaos soak (tools/soak.py, docs/training.md "Fault tolerance"): a 2-rank run under random faults
of every kind, relaunched as a scheduler would, ends on the uninterrupted run's weights bit for bit, with
the same loss curve and no checkpoint lost; and it fails when the corrupt-checkpoint fallback
(--on-bad-checkpoint refuse) or the hang detection (a collective timeout too long to matter) is off.

Each case runs real processes (a tiny GPT at DP2 with the distributed optimizer and --async-save), so the
file takes about two minutes on two cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.cli_utils import ROOT

SOAK = str(ROOT / "tools" / "soak.py")


def _soak(tmp_path, *args: str) -> tuple[dict, str]:
    out = str(tmp_path / "soak.json")
    proc = subprocess.run([sys.executable, SOAK, "--workdir", str(tmp_path / "w"), "--json", out, *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    text = proc.stdout + proc.stderr
    assert os.path.isfile(out), text[-3000:]
    report = json.load(open(out))
    assert proc.returncode == (0 if report["passed"] else 1), text[-3000:]
    return report, text


def test_short_soak_ends_on_the_uninterrupted_runs_weights(tmp_path):
    report, text = _soak(tmp_path, "--seed", "3", "--faults", "7", "--train-iters", "40", "--save-interval", "4")
    assert report["passed"], text[-4000:]
    kinds = report["faults_by_kind"]
    assert sum(kinds.values()) >= 6 and len(kinds) >= 5, kinds
    assert report["restarts"] >= 4
    assert report["losses_equal"] and report["weights_equal"], text[-3000:]
    assert report["ever_complete"] and report["missing_checkpoints"] == []
    by_kind = {f["kind"]: f for f in report["faults"]}
    if "hang" in by_kind:  # the failure board named the stopped rank
        assert "the failure board named it" in by_kind["hang"]["detail"], by_kind["hang"]
    if "corrupt" in by_kind:  # the damaged newest checkpoint was set aside with a notice, not deleted
        assert any("fails its checks" in n and "set aside as iter_" in n for n in report["notices"]), report["notices"]
    if "disk-full" in by_kind:
        assert "failed" in by_kind["disk-full"]["detail"] and "missed" not in by_kind["disk-full"]["detail"]


def test_soak_fails_when_the_corrupt_checkpoint_fallback_is_off(tmp_path):
    from tools.soak import MODEL

    report, text = _soak(tmp_path, "--seed", "1", "--faults", "2", "--kinds", "sigkill,corrupt", "--train-iters", "24",
                         "--save-interval", "3", "--", *MODEL, "--on-bad-checkpoint", "refuse")
    assert not report["passed"]
    assert "without a fault" in report["failure"] and "fails its checks" in report["failure"], report["failure"]
    assert "--on-bad-checkpoint refuse" in report["failure"]


def test_soak_fails_when_hang_detection_is_off(tmp_path):
    report, text = _soak(tmp_path, "--seed", "1", "--faults", "1", "--kinds", "hang", "--train-iters", "24",
                         "--save-interval", "3", "--hang-detection", "off", "--hang-limit-s", "20")
    assert not report["passed"]
    assert "the hang was not detected" in report["failure"], report["failure"]


# ---- the runtime behaviours the soak relies on, one at a time, in-process (one rank) ------------------

def _train(save: str, iters: int, lines: list[str] | None = None, **kw):
    from megalite.config import validate
    from megalite.config.arguments import MegaliteConfig
    from megalite.training.loop import pretrain
    from tests.tp_utils import groups_for, mock_data

    flat = dict(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, micro_batch_size=2,
                global_batch_size=2, train_iters=iters, lr=1e-3, mock_data=True, vocab_size=64, eval_iters=0,
                log_interval=1, hidden_dropout=0.0, attention_dropout=0.0, save=save, load=save, save_interval=2)
    flat.update(kw)
    cfg = MegaliteConfig.from_flat(flat)
    validate(cfg, 1)
    return pretrain(cfg, groups_for(1, 0), data=mock_data(64, 8, 1234, 200),
                    log=(lines.append if lines is not None else lambda s: None))


def test_a_corrupt_newest_checkpoint_is_set_aside_and_a_garbled_tracker_scanned(tmp_path):
    import pytest

    from megalite.checkpointing.errors import CheckpointError
    from megalite.checkpointing.fallback import resume_point
    from megalite.checkpointing.paths import TRACKER
    from tools.soak_parts.checks import corrupt_newest, passing

    d = str(tmp_path / "ck")
    _train(d, 6)  # iterations 2, 4, 6
    corrupt_newest(d, __import__("random").Random(0))
    with open(os.path.join(d, TRACKER), "w") as f:
        f.write("six\n")
    notes: list[str] = []
    with pytest.raises(CheckpointError, match="--on-bad-checkpoint refuse"):
        resume_point(d, True, notes.append)
    assert sorted(os.listdir(d)) == ["iter_0000002", "iter_0000004", "iter_0000006", TRACKER] and not notes
    assert resume_point(d, False, notes.append) == 4
    names = os.listdir(d)
    assert "iter_0000006" not in names and any(n.startswith("iter_0000006.corrupt-") for n in names)
    assert any(n.startswith(f"{TRACKER}.corrupt-") for n in names)  # the garbled tracker is kept too
    assert open(os.path.join(d, TRACKER)).read() == "4" and passing(d) == [4, 2]
    assert len(notes) == 3 and "fails its checks" in notes[1] and "set aside as iter_0000006.corrupt-" in notes[1]
    os.remove(os.path.join(d, TRACKER))  # deleted: the newest folder that passes
    assert resume_point(d, False, notes.append) == 4 and "is missing; scanning" in notes[-2]


def test_a_failed_periodic_save_is_retried_and_n_in_a_row_stop_the_run(tmp_path, monkeypatch):
    import errno

    import pytest

    from megalite.checkpointing import save as save_module
    from megalite.training.save_retry import SavesKeepFailing

    real, failing = save_module.save_tensors, {"iter_0000002"}

    def disk_full(tensors, path, metadata=None):
        if any(f".{it}.incomplete" in path for it in failing):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real(tensors, path, metadata)

    monkeypatch.setattr(save_module, "save_tensors", disk_full)
    d, lines = str(tmp_path / "ck"), []
    result = _train(d, 6, lines)
    assert len(result.losses) == 6
    warned = [s for s in lines if "WARNING" in s]
    assert len(warned) == 1 and "saving iteration 2 failed" in warned[0] and "training goes on" in warned[0]
    assert sorted(n for n in os.listdir(d) if n.startswith("iter_")) == ["iter_0000004", "iter_0000006"]
    failing.update({"iter_0000008", "iter_0000010"})
    with pytest.raises(SavesKeepFailing, match="2 of --max-consecutive-failed-saves 2 in a row failed"):
        _train(d, 12, max_consecutive_failed_saves=2)
    assert open(os.path.join(d, "latest_checkpointed_iteration.txt")).read() == "6"


def test_a_tracker_fault_on_a_folder_without_a_tracker_garbles_one(tmp_path):
    """Two tracker faults in a row (the run killed before it wrote a tracker again): the second writes a
    garbled one instead of failing the soak on a file that is not there."""
    import random

    from megalite.checkpointing.paths import TRACKER
    from tools.soak_parts.checks import damage_tracker

    for seed in range(8):
        assert damage_tracker(str(tmp_path), random.Random(seed)) == "garbled"
        os.remove(tmp_path / TRACKER)
