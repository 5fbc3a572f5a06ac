"""Bad flags and bad --config files through pretrain_gpt.py: each exits non-zero with one message
naming the flag, key, file or line, and no traceback. Validation happens before any process group, so
most cases run the entry point's main() in-process (training is stubbed out: a case that validated
would fail loudly); a handful go through the real subprocess."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.cli_utils import ROOT, launch_pretrain, run_pretrain

# main() run in-process under capsys: torch's @record cannot attach its fault handler there.
pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")

BASE = ["--mock-data", "--vocab-size", "64", "--train-iters", "2", "--num-layers", "2", "--hidden-size", "16",
        "--num-attention-heads", "2", "--seq-length", "8"]


def _entry():
    spec = importlib.util.spec_from_file_location("pretrain_gpt_entry", ROOT / "pretrain_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def entry():
    return _entry()


def run_main(entry, monkeypatch, capsys, argv):
    """(exit code, stderr) of pretrain_gpt.main(argv) with training replaced by a failure."""
    def no_training(cfg):
        raise AssertionError(f"validation accepted {argv}")

    monkeypatch.setattr(entry, "distributed_run", no_training)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    try:
        rc = entry.main(argv)
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


# (extra flags, text the message must hold)
FLAG_CASES = {
    "misspelled flag": (["--hiden-size", "64"], "did you mean --hidden-size?"),
    "misspelled switch": (["--sequence-paralel"], "did you mean --sequence-parallel?"),
    "kv-channels 0": (["--kv-channels", "0"], "--kv-channels must be an integer in [1, 67108864], got 0"),
    "ffn negative": (["--ffn-hidden-size", "-4"], "--ffn-hidden-size must be an integer in [1, 1073741824], got -4"),
    "global batch 0": (["--global-batch-size", "0"], "--global-batch-size must be an integer in [1, "),
    "norm epsilon 0": (["--norm-epsilon", "0"], "--norm-epsilon must be a finite number in (0, 1], got 0.0"),
    "init std negative": (["--init-method-std", "-0.02"], "--init-method-std must be a finite number > 0, got -0.02"),
    "rotary percent > 1": (["--rotary-percent", "1.5"], "--rotary-percent must be a finite number in (0, 1], got 1.5"),
    "rotary percent 0": (["--rotary-percent", "0"], "--rotary-percent must be a finite number in (0, 1], got 0.0"),
    "adam beta1 1": (["--adam-beta1", "1.0"], "--adam-beta1 must be a finite number in [0, 1), got 1.0"),
    "adam beta2 negative": (["--adam-beta2", "-0.1"], "--adam-beta2 must be a finite number in [0, 1), got -0.1"),
    "loss scale 0": (["--fp16", "--loss-scale", "0"], "--loss-scale must be a finite number in (0, "),
    "timeout 0": (["--distributed-timeout-minutes", "0"],
         "--distributed-timeout-minutes must be a finite number in (0, "),
    "query groups without GQA": (["--num-query-groups", "1"], "--num-query-groups (1) needs --group-query-attention"),
    "recompute method alone": (["--recompute-method", "block"], "--recompute-method block needs"),
    "recompute method selective": (["--recompute-method", "uniform", "--recompute-granularity", "selective"],
                                   "--recompute-method uniform needs --recompute-granularity full"),
    "iters and samples": (["--train-samples", "100"], "--train-iters and --train-samples are exclusive"),
    "warmup samples with iters": (["--lr-warmup-samples", "8"], "--lr-warmup-samples needs --train-samples"),
    "WSD without anneal": (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    "wsd samples with iters": (["--lr-wsd-decay-samples", "4"], "--lr-wsd-decay-samples needs --train-samples"),
    "warmup fraction and iters": (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "1", "--lr-decay-iters", "9"],
                                  "--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples are exclusive"),
    "warmup fraction 1.5": (["--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction must be a finite number in [0, 1)"),
    "warmup init above lr": (["--lr-warmup-init", "1.0"], "--lr-warmup-init (1.0) <= --lr"),
    "unknown decay style": (["--lr-decay-style", "step"], "--lr-decay-style: invalid choice"),
    "not a number": (["--lr", "fast"], "--lr: invalid float value"),
    "wsd longer than decay": (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "5"],
                              "--lr-wsd-decay-iters (5) must be <= the decay span"),
}


@pytest.mark.parametrize("case", FLAG_CASES)
def test_bad_flag(entry, monkeypatch, capsys, case):
    extra, expected = FLAG_CASES[case]
    rc, err = run_main(entry, monkeypatch, capsys, BASE + extra)
    assert rc not in (0, None), err
    assert expected in err, err
    assert "Traceback" not in err


def test_train_samples_below_one_batch(entry, monkeypatch, capsys):
    i = BASE.index("--train-iters")
    argv = BASE[:i] + BASE[i + 2:]
    rc, err = run_main(entry, monkeypatch, capsys, argv + ["--train-samples", "3", "--global-batch-size", "4"])
    assert rc == 2 and "--train-samples (3) must be at least one global batch (4)" in err, err


def test_a2a_with_fewer_query_groups_than_tp_ranks_is_refused_before_any_group(entry, monkeypatch, capsys):
    """8 heads, 1 query group at TP2 x CP2 a2a: each TP rank holds a replica of the one group, which does not
    split 2 ways. The entry point's full validation (--dry-run on 4 ranks) refuses it instead of the first
    forward's ValueError."""
    layout = [*BASE, "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "1",
              "--tensor-model-parallel-size", "2", "--context-parallel-size", "2"]
    on_4_ranks = ["--dry-run", "--num-nodes", "1", "--gpus-per-node", "4"]
    rc, err = run_main(entry, monkeypatch, capsys, [*layout, "--cp-comm-type", "a2a", *on_4_ranks])
    assert rc == 2, err
    assert ("--cp-comm-type a2a: --num-query-groups per tensor-parallel rank (1 over 2 ranks: 1 each, replicated) "
            "must be divisible by --context-parallel-size (2)") in err, err
    assert "Traceback" not in err
    rc, err = run_main(entry, monkeypatch, capsys, [*layout, "--cp-comm-type", "p2p", "a2a", *on_4_ranks])
    assert rc == 2 and "--cp-comm-type a2a: --num-query-groups" in err, err  # the one layer that uses it
    rc, err = run_main(entry, monkeypatch, capsys, [*layout, "--cp-comm-type", "p2p", "all_gather", *on_4_ranks])
    assert rc == 0, err  # the ring and the all-gather split no heads


# (file name, file text, text the message must hold)
FILE_CASES = {
    "yaml string number": ("run.yaml", "lr: 1e-3\n", "'lr' expects a number, got str '1e-3' (YAML reads"),
    "quoted no": ("run.yaml", 'fp16: "no"\n', "'fp16' expects true or false, got str 'no'"),
    "seed list": ("run.yaml", "seed: [1, 2]\n", "'seed' expects an integer, got list [1, 2]"),
    "data path string": ("run.yaml", "data_path: corpus_text_document\n",
                         "'data_path' expects a list of strings, got str"),
    "misspelled key": ("run.yaml", "hiden_size: 64\n", "unknown key 'hiden_size' (did you mean hidden_size?)"),
    "misspelled nested": ("run.json", json.dumps({"model": {"num_layer": 2}}),
                          "unknown key 'model.num_layer' (did you mean num_layers?)"),
    "nested wrong type": ("run.json", json.dumps({"model": {"num_layers": "two"}}),
                          "'model.num_layers' expects an integer, got str 'two'"),
    "bad choice": ("run.yaml", "lr_decay_style: step\n", "'lr_decay_style' must be one of constant"),
    "null size": ("run.yaml", "num_layers: null\n", "'num_layers' cannot be null"),
    "float for int": ("run.json", '{"train_iters": 2.5}', "'train_iters' expects an integer, got float 2.5"),
    "bool for int": ("run.json", '{"micro_batch_size": true}', "'micro_batch_size' expects an integer, got bool"),
    "malformed yaml": ("run.yaml", "lr: 0.1\nmodel:\n  num_layers: 2\n bad indent: [\n",
                       "malformed YAML in {path}, line 4"),
    "malformed json": ("run.json", '{"lr": 0.1,\n "seed": }\n', "malformed JSON in {path}, line 2"),
    "not a mapping": ("run.yaml", "- lr\n- seed\n", "must hold a mapping of flag names to values"),
}


# (file name, file text, text the message must hold): a setting written twice is refused, both lines named.
DUPLICATE_CASES = {
    "yaml key twice": ("run.yaml", "lr: 0.1\nseed: 3\nlr: 0.2\n", "key 'lr' is written twice (lines 1 and 3)"),
    "yaml nested key twice": ("run.yaml", "model:\n  num_layers: 2\n  num_layers: 4\n",
                              "key 'model.num_layers' is written twice (lines 2 and 3)"),
    "json key twice": ("run.json", '{"lr": 0.1,\n "seed": 3,\n "lr": 0.2}',
                       "key 'lr' is written twice (lines 1 and 3)"),
    "flat and nested": ("run.yaml", "hidden_size: 16\nmodel:\n  hidden_size: 32\n",
                        "hidden_size is given twice: 'hidden_size' (line 1) and 'model.hidden_size' (line 3)"),
    "two spellings": ("run.yaml", "hidden-size: 16\nhidden_size: 32\n",
                      "hidden_size is given twice: 'hidden-size' (line 1) and 'hidden_size' (line 2)"),
    "type error names its line": ("run.yaml", "seed: 1\nlr: 1e-3\n", "{path}, line 2: 'lr' expects a number"),
    "unknown key names its line": ("run.yaml", "seed: 1\nhiden_size: 64\n", "{path}, line 2: unknown key 'hiden_size'"),
}


@pytest.mark.parametrize("case", {**FILE_CASES, **DUPLICATE_CASES})
def test_bad_config_file(entry, monkeypatch, capsys, tmp_path, case):
    name, text, expected = {**FILE_CASES, **DUPLICATE_CASES}[case]
    path = tmp_path / name
    path.write_text(text)
    rc, err = run_main(entry, monkeypatch, capsys, BASE + ["--config", str(path)])
    assert rc == 2, err
    assert expected.format(path=path) in err, err
    assert "Traceback" not in err


def test_missing_config_file(entry, monkeypatch, capsys, tmp_path):
    rc, err = run_main(entry, monkeypatch, capsys, BASE + ["--config", str(tmp_path / "nope.yaml")])
    assert rc == 2 and f"file {tmp_path / 'nope.yaml'} does not exist" in err, err


def test_good_config_file_is_typed(tmp_path):
    """The same checks accept what they should: ints for floats, null for optional fields, nested sections."""
    from megalite.config import parse_args

    path = tmp_path / "run.yaml"
    path.write_text("lr: 1\nglobal_batch_size: null\nmodel: {num_layers: 3}\ndata_path: [a]\nfp16: false\n")
    cfg = parse_args(["--config", str(path)])
    assert (cfg.optimizer.lr, cfg.model.num_layers, cfg.data.data_path) == (1.0, 3, ["a"])
    assert isinstance(cfg.optimizer.lr, float)


# Through the real entry point (its main on a rank; the YAML case as a user runs it, a process).
SUBPROCESS_CASES = {
    "misspelled flag": (["--num-layer", "2"], "did you mean --num-layers?"),
    "zero size": (["--kv-channels", "0"], "--kv-channels must be an integer in [1, 67108864], got 0"),
    "ignored query groups": (["--num-query-groups", "1"], "needs --group-query-attention"),
}


@pytest.mark.parametrize("case", SUBPROCESS_CASES)
def test_bad_flag_subprocess(case):
    extra, expected = SUBPROCESS_CASES[case]
    proc = launch_pretrain(BASE + extra)
    assert proc.returncode != 0
    assert expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_bad_yaml_subprocess(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lr: 1e-3\n")
    proc = run_pretrain(BASE + ["--config", str(path)], timeout=120)
    assert proc.returncode == 2 and "'lr' expects a number" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


# ---- duplicate keys and where a value was written (issue 25, classes 4 and 6) -----------------------------



def test_config_directory_is_named_a_directory(entry, monkeypatch, capsys, tmp_path):
    rc, err = run_main(entry, monkeypatch, capsys, BASE + ["--config", str(tmp_path)])
    assert rc == 2 and f"--config: {tmp_path} is a directory, not a file" in err, err


def test_rule_broken_by_a_config_value_names_key_and_line(entry, monkeypatch, capsys, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seed: 1\nmodel:\n  kv_channels: 0\n")
    rc, err = run_main(entry, monkeypatch, capsys, BASE + ["--config", str(path)])
    assert rc not in (0, None), err
    assert f"--kv-channels must be an integer in [1, 67108864], got 0 (from 'model.kv_channels' in {path}, line 3)" \
        in err, err
    # the command line wins, and then names itself
    rc, err = run_main(entry, monkeypatch, capsys, BASE + ["--config", str(path), "--kv-channels", "-1"])
    assert "--kv-channels must be an integer in [1, 67108864], got -1" in err and "(from " not in err, err


def test_deepspeed_duplicate_key_named_with_both_lines(entry, monkeypatch, capsys, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 1,\n "zero_optimization": {"stage": 1,\n'
                    '   "stage": 2}}\n')
    rc, err = run_main(entry, monkeypatch, capsys, BASE + ["--deepspeed-config", str(path)])
    assert rc == 2, err
    assert f"--deepspeed-config {path}: key 'zero_optimization.stage' is written twice (lines 2 and 3)" in err, err


def test_deepspeed_value_breaking_a_rule_names_its_json_key(entry, monkeypatch, capsys, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "steps_per_print": 0,
                                "optimizer": {"type": "AdamW", "params": {"eps": 0}}}, indent=1))
    rc, err = run_main(entry, monkeypatch, capsys, BASE + ["--deepspeed-config", str(path)])
    assert rc not in (0, None), err
    assert f"(from 'steps_per_print' in {path})" in err, err
    assert f"(from 'optimizer.params.eps' in {path})" in err, err


def test_deepspeed_directory_is_named_a_directory(entry, monkeypatch, capsys, tmp_path):
    rc, err = run_main(entry, monkeypatch, capsys, BASE + ["--deepspeed-config", str(tmp_path)])
    assert rc == 2 and f"--deepspeed-config: {tmp_path} is a directory, not a file" in err, err


@pytest.mark.parametrize("flags, expected", [
    (["--moe-ffn-hidden-size", "0"], "--moe-ffn-hidden-size must be an integer in [1, 1073741824], got 0"),
    (["--moe-shared-expert-intermediate-size", "0", "--moe-shared-expert-gate"],
     "--moe-shared-expert-intermediate-size must be an integer in [1, 1073741824], got 0"),
])
def test_zero_moe_size_is_not_called_missing(entry, monkeypatch, capsys, flags, expected):
    rc, err = run_main(entry, monkeypatch, capsys, BASE + ["--num-experts", "2", "--disable-bias-linear", *flags])
    assert rc not in (0, None) and expected in err, err
    assert "needs --moe-shared-expert-intermediate-size" not in err, err
