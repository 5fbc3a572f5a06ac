"""Every number megalite parses is checked against its domain, numbers written inside strings included:
each entry of ``--split``, each blend weight of every data-path flag (on the command line and in a --config
file); and domains respect the type the value ends up in (fp32 for learning rates and the sampling
temperature, DeepSpeed's loss-scale power). Each bad value is named (flag, entry, rule) before any file is
read, instead of being dropped (a regular expression kept '1' of '-1'), carried into NaN sample counts, or
ending in a traceback."""

from __future__ import annotations

import math

import pytest

from tests.cli_utils import load_tool

pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")

BASE = ["--vocab-size", "64", "--train-iters", "2", "--num-layers", "1", "--hidden-size", "16",
        "--num-attention-heads", "2", "--seq-length", "8", "--tokenizer-type", "NullTokenizer"]
DATA_PATH_FLAGS = ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path")
BAD_WEIGHTS = ["inf", "nan", "-1", "-0.5", "0", "1e999"]
BAD_SPLITS = {"1,nan,0": "the valid proportion", "1,-1,1": "the valid proportion", "1,,0": "got nothing",
              "1,2,3,4": "up to three", "a,1,1": "the train proportion", "inf,1,1": "the train proportion",
              "-5": "the train proportion", "0,0,0": "must not all be zero", "1e308,1e308,1": "overflows",
              "1/2/nan": "the test proportion"}


def _validated(argv: list[str]) -> str:
    """The message with which the config of ``argv`` is refused (parse or validate), '' if accepted."""
    from megalite.config.arguments import parse_args
    from megalite.config.validate import ConfigError, validate

    try:
        validate(parse_args(argv), world_size=1)
    except SystemExit as e:
        assert e.code not in (0, None)
        return "refused by the parser"
    except ConfigError as e:
        return str(e)
    return ""


def _parser_message(argv: list[str], capsys) -> str:
    from megalite.config.arguments import parse_args
    from megalite.config.validate import ConfigError, validate

    try:
        validate(parse_args(argv), world_size=1)
    except SystemExit as e:
        assert e.code not in (0, None)
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return err
    except ConfigError as e:
        return str(e)
    raise AssertionError(f"accepted: {argv}")


def _weighted(flag: str, weight: str) -> list[str]:
    paths = [flag, weight, "a", "1", "b"]
    return paths + (["--train-data-path", "c"] if flag in ("--valid-data-path", "--test-data-path") else [])


@pytest.mark.parametrize("weight", BAD_WEIGHTS)
@pytest.mark.parametrize("flag", DATA_PATH_FLAGS)
def test_every_data_path_flag_refuses_a_weight_outside_its_domain(flag, weight, capsys):
    message = _parser_message([*BASE, *_weighted(flag, weight)], capsys)
    assert f"{flag}: the blend weight of 'a' must be a finite number > 0, got {weight}" in message, message


@pytest.mark.parametrize("flag", DATA_PATH_FLAGS)
def test_every_data_path_flag_takes_finite_positive_weights(flag):
    from megalite.config.data_values import blend_weights

    assert blend_weights(["0.3", "a", "7e-1", "b"], flag) == (["a", "b"], [0.3, 0.7])
    assert blend_weights(["a", "b"], flag) == (["a", "b"], None)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
@pytest.mark.parametrize("weight", ["inf", "nan", "-1"])
@pytest.mark.parametrize("key", ["data_path", "train_data_path"])
def test_config_file_weights_are_checked_as_the_flags_are(key, weight, suffix, tmp_path, capsys):
    path = tmp_path / f"run{suffix}"
    if suffix == ".json":
        path.write_text(f'{{"{key}": ["{weight}", "a", "1", "b"]}}')
    else:
        path.write_text(f'{key}: ["{weight}", a, "1", b]\n')
    message = _parser_message([*BASE, "--config", str(path)], capsys)
    flag = "--" + key.replace("_", "-")
    assert f"{flag}: the blend weight of 'a' must be a finite number > 0, got {weight}" in message, message


@pytest.mark.parametrize("split", list(BAD_SPLITS))
def test_every_split_entry_is_a_finite_number_at_least_zero(split, capsys):
    message = _parser_message([*BASE, "--data-path", "a", "--split", split], capsys)
    assert f"--split {split!r}: " in message and BAD_SPLITS[split] in message, message


def test_split_in_a_config_file_is_checked(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("data_path: [a]\nsplit: '98,nan,2'\n")
    message = _parser_message([*BASE, "--config", str(path)], capsys)
    assert "--split '98,nan,2': the valid proportion must be a finite number >= 0, got nan" in message, message


@pytest.mark.parametrize("split, expected", [("969,30,1", [0.969, 0.03, 0.001]), ("1", [1, 0, 0]),
                                             ("98/1/1", [0.98, 0.01, 0.01]), (" 2, 2 ", [0.5, 0.5, 0]),
                                             ("1e2,0,0", [1, 0, 0])])
def test_good_splits_are_normalised(split, expected):
    from megalite.config.data_values import split_proportions

    assert split_proportions(split) == pytest.approx(expected)


def test_the_dataset_builder_parses_as_validation_does():
    from megalite.data.builder import parse_blend, parse_split
    from megalite.data.errors import DataError

    for split in BAD_SPLITS:
        with pytest.raises(DataError, match="--split"):
            parse_split(split)
    with pytest.raises(DataError, match="blend weight of 'a'"):
        parse_blend(["nan", "a"], "--data-path")


# --- domains in the type the value ends up in --------------------------------------------------------------

def _float_fields() -> dict[str, tuple[str, object]]:
    """{flag: (field name, domain)} of every float field of the config."""
    import typing

    from megalite.config import MegaliteConfig
    from megalite.config.flags import _domains

    out = {}
    for cls in typing.get_type_hints(MegaliteConfig).values():
        if isinstance(cls, type) and hasattr(cls, "__dataclass_fields__"):
            out.update({flag: (name, domain) for name, flag, domain, integer in _domains(cls)
                        if domain is not None and not integer})
    return out


LEARNING_RATES = ["--lr", "--min-lr", "--decoupled-lr", "--decoupled-min-lr", "--lr-warmup-init"]


def test_every_learning_rate_is_an_fp32_value():
    """Every float flag that is a learning rate (its name ends in lr, or is the warm-up's start) declares the
    fp32 domain."""
    rates = {flag: domain for flag, (name, domain) in _float_fields().items()
             if name.endswith("lr") or name == "lr_warmup_init"}
    assert sorted(rates) == sorted(LEARNING_RATES)
    assert all(domain.fp32 for domain in rates.values()), rates


@pytest.mark.parametrize("value", ["1e39", "1e-39", "1e-320"])
@pytest.mark.parametrize("flag", LEARNING_RATES)
def test_learning_rates_outside_fp32_are_refused(flag, value, capsys):
    extra = ["--lr", "1e39"] if flag in ("--min-lr", "--lr-warmup-init") and value == "1e39" else []
    message = _parser_message(["--mock-data", *BASE, *extra, flag, value], capsys)
    assert f"{flag} must be a finite number >= 0 that fp32 holds" in message, message


def test_a_large_learning_rate_fp32_holds_is_accepted():
    assert _validated(["--mock-data", *BASE, "--lr", "1e30"]) == ""
    assert _validated(["--mock-data", *BASE, "--lr", "0"]) == ""


@pytest.mark.parametrize("value", ["1e-39", "1e-320", "1e39"])
def test_generate_refuses_a_temperature_fp32_cannot_divide_by(value, capsys):
    with pytest.raises(SystemExit):
        load_tool("generate").main(["--load", "x", "--prompt", "a", "--temperature", value])
    err = capsys.readouterr().err
    assert "--temperature" in err and "that fp32 holds" in err and "Traceback" not in err, err


def test_a_small_normal_temperature_samples_the_argmax_instead_of_nan():
    import torch

    from megalite.inference.sampling import SamplingParams, sample

    logits = torch.tensor([[1.0, 90.0, 3.0], [5.0, -2.0, 4.0]])
    got = sample(logits, SamplingParams(temperature=2e-38), torch.Generator().manual_seed(0))
    assert got.tolist() == [1, 0]


@pytest.mark.parametrize("power", [2000, 10**12, -200, 65])
def test_deepspeed_initial_scale_power_must_give_an_fp32_loss_scale(power, tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(f'{{"fp16": {{"enabled": true, "initial_scale_power": {power}}}}}')
    message = _parser_message(["--mock-data", *BASE, "--deepspeed-config", str(path)], capsys)
    assert "fp16.initial_scale_power: 2^power is the initial loss scale" in message, message
    assert f"got {power}" in message


def test_deepspeed_initial_scale_power_in_range_sets_the_scale(tmp_path):
    from megalite.config.arguments import parse_args

    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 2, "fp16": {"enabled": true, "initial_scale_power": 12}}')
    cfg = parse_args(["--mock-data", *BASE, "--deepspeed-config", str(path)])
    assert cfg.precision.initial_loss_scale == 4096.0 and math.isfinite(cfg.precision.initial_loss_scale)
