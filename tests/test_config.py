"""Promises: every invalid flag combination is rejected before any process group exists, with a
message naming the flags and the rule; --config files supply fields and command-line flags win."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megalite.config import ConfigError, parse_args, validate

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--mock-data", "--vocab-size", "1000", "--num-layers", "4", "--hidden-size", "64",
        "--num-attention-heads", "8", "--seq-length", "32", "--micro-batch-size", "2"]


def check(extra: list[str], world: int = 1):
    cfg = parse_args(BASE + extra)
    validate(cfg, world)
    return cfg


def test_valid_config_fills_global_batch_default():
    cfg = check(["--tensor-model-parallel-size", "2"], world=8)
    assert cfg.training.global_batch_size == 2 * 4  # micro-batch x DP


@pytest.mark.parametrize("extra,world,fragments", [
    (["--hidden-size", "60"], 1, ["--hidden-size (60)", "--num-attention-heads (8)"]),
    (["--tensor-model-parallel-size", "3"], 3, ["--num-attention-heads (8)", "--tensor-model-parallel-size (3)"]),
    (["--group-query-attention", "--num-query-groups", "3"], 1, ["--num-query-groups (3)"]),
    (["--group-query-attention"], 1, ["--group-query-attention needs --num-query-groups"]),
    (["--group-query-attention", "--num-query-groups", "4", "--num-attention-heads", "12", "--hidden-size", "96",
      "--tensor-model-parallel-size", "3"], 3, ["--num-query-groups (4)", "must divide one another"]),
    (["--tensor-model-parallel-size", "2"], 3, ["world size (3)", "--tensor-model-parallel-size (2)"]),
    (["--global-batch-size", "6", "--tensor-model-parallel-size", "2"], 8,
     ["--global-batch-size (6)", "--micro-batch-size (2)", "data-parallel size (4"]),
    (["--ffn-hidden-size", "100", "--tensor-model-parallel-size", "8"], 8, ["--ffn-hidden-size (100)"]),
    (["--seq-length", "64", "--max-position-embeddings", "32"], 1, ["--seq-length (64)", "--max-position-embeddings"]),
    (["--sequence-parallel"], 1, ["--sequence-parallel needs --tensor-model-parallel-size > 1"]),
    (["--hidden-dropout", "1.5"], 1, ["--hidden-dropout must be a finite number in [0, 1), got 1.5"]),
    (["--lr", "1e-4", "--min-lr", "1e-3"], 1, ["--min-lr", "--lr"]),
    (["--num-layers", "0"], 1, ["--num-layers must be an integer in [1, 100000], got 0"]),
    (["--context-parallel-size", "2"], 3, ["world size (3)", "--context-parallel-size (2)"]),
    (["--context-parallel-size", "3"], 3, ["--seq-length (32) must be divisible by 2 x --context-parallel-size (3)"]),
    (["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length",
      "36", "--max-position-embeddings", "36"], 4, ["--seq-length (36)", "(sequence parallelism) = 8"]),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--group-query-attention", "--num-query-groups", "2"],
     4, ["--cp-comm-type a2a: --num-query-groups per tensor-parallel rank (2 / 1 = 2)", "--context-parallel-size (4)"]),
    # fewer query groups than TP ranks: each rank holds one group's replica, which does not split 2 ways
    (["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--cp-comm-type", "a2a",
      "--group-query-attention", "--num-query-groups", "1"], 4,
     ["--cp-comm-type a2a: --num-query-groups per tensor-parallel rank (1 over 2 ranks: 1 each, replicated) must be "
      "divisible by --context-parallel-size (2)"]),
    (["--context-parallel-size", "4", "--cp-comm-type", "p2p", "a2a"], 4,
     ["--cp-comm-type has 2 values: give one (for every layer) or one per layer (--num-layers 4)"]),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p"], 4,
     ["--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes"]),
    (["--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "3"], 4,
     ["--hierarchical-context-parallel-sizes (2 x 3 = 6) must multiply to --context-parallel-size (4)"]),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "4", "1",
      "--group-query-attention", "--num-query-groups", "2"], 4,
     ["--cp-comm-type a2a+p2p: --num-query-groups per tensor-parallel rank (2 / 1 = 2) must be divisible by the "
      "all-to-all size, the first --hierarchical-context-parallel-sizes (4)"]),
    (["--context-parallel-size", "2", "--hierarchical-dp-reduce"], 4, ["--hierarchical-dp-reduce is not supported"]),
    (["--data-path", "x"], 1, ["--mock-data and --data-path"]),
    (["--train-iters", "-1"], 1, ["--train-iters must be an integer in [1, ", "got -1"]),
])
def test_invalid_combination_names_flags_and_rule(extra, world, fragments):
    with pytest.raises(ConfigError) as err:
        check(extra, world)
    for f in fragments:
        assert f in str(err.value), str(err.value)


def test_missing_data_source_and_vocab():
    cfg = parse_args(["--num-layers", "2"])
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1)
    assert "--mock-data" in str(err.value) and "--vocab-size" in str(err.value)


def test_config_file_supplies_fields_and_flags_win(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"model": {"hidden-size": 128, "num_layers": 6}, "lr": 0.5, "mock_data": True}))
    cfg = parse_args(["--config", str(path), "--num-layers", "3", "--vocab-size", "10"])
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.optimizer.lr) == (128, 3, 0.5)
    assert cfg.data.mock_data
    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text("hidden_size: 96\nswiglu: true\n")
    cfg = parse_args(["--config", str(yaml_path)])
    assert cfg.model.hidden_size == 96 and cfg.model.swiglu and cfg.model.ffn_hidden_size == 256


def test_config_file_unknown_field_is_an_error(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"hiden_size": 3}))
    with pytest.raises(SystemExit):
        parse_args(["--config", str(path)])
    assert "hiden_size" in capsys.readouterr().err


def test_help_documents_every_flag():
    out = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), "--help"], capture_output=True, text=True,
                         check=True).stdout
    for flag in ["--num-layers", "--group-query-attention", "--tensor-model-parallel-size", "--lr-decay-style",
                 "--make-vocab-size-divisible-by", "--mock-data", "--tokenizer-type", "--config", "--eval-iters",
                 "--untie-embeddings-and-output-weights", "--position-embedding-type"]:
        assert flag in out


def test_cli_rejects_before_starting(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *BASE, "--hidden-size", "60"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--hidden-size (60) must be divisible by --num-attention-heads (8)" in proc.stderr
