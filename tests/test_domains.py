"""Every numeric flag has a declared domain, and every entry point enforces it (issue 25, classes 1, 3, 9).

The walk is enumerated from the config dataclasses and from the entry points' parsers, so a new field or
option is covered without touching this file. Each probe (nan, inf, -inf, -1, 0, a huge value) goes
through the real parser and validate(), in-process: outside the domain it must get an error naming the
flag; inside, its meaning must be in the flag's help (the domain, and the off value's meaning).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import io
import math
import sys
import typing
from pathlib import Path

import pytest

from megalite.checkpointing.metadata import model_config
from megalite.checkpointing.reader import CheckpointError
from megalite.config import ConfigError, parse_args, validate
from megalite.config.arguments import SECTIONS, build_parser
from megalite.config.domain import Domain, DomainType
from megalite.config.flags import field_domain, flag_name, numeric
from megalite.planning.cli import plan_main
from megalite.planning.hardware import ClusterConfig

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # @record under capture
BASE = ["--mock-data", "--vocab-size", "64"]
CLASSES = [*SECTIONS.values(), ClusterConfig]
PROBES = ["nan", "inf", "-inf", "-1", "0", "huge"]


def _numeric_fields(classes=CLASSES):
    out = []
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = typing.get_args(hints[f.name])[0] if type(None) in typing.get_args(hints[f.name]) else hints[f.name]
            kind = numeric(tp)
            if kind is not None:
                out.append((cls, f, kind, typing.get_origin(tp) is list))
    return out


FIELDS = _numeric_fields()
CONFIG_FIELDS = [x for x in FIELDS if x[0] is not ClusterConfig]


def _value(probe: str, kind: type) -> float:
    if probe == "huge":
        return 2**62 if kind is int else 1e30
    return float(probe) if probe in ("nan", "inf", "-inf") else int(probe)


def _text(probe: str, kind: type) -> str:
    return str(_value(probe, kind))


def _admitted(domain: Domain, value: float, kind: type) -> bool:
    """What the parser should let through: an int field takes no float text (argparse refuses it)."""
    if kind is int and isinstance(value, float):
        return False
    return domain.admits(value)


def _run(argv: list[str], base: list[str] = BASE) -> tuple[str, str]:
    """('argparse' | 'config' | 'ok', message) of pretrain_gpt.py's parse + validate, in-process."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            cfg = parse_args(base + argv)
    except SystemExit as e:
        assert e.code == 2
        return "argparse", err.getvalue()
    try:
        validate(cfg, 1)
    except ConfigError as e:
        return "config", str(e)
    return "ok", ""


HELP = {a.dest: a.help or "" for a in build_parser()._actions}


@pytest.fixture
def one_parser(monkeypatch):
    """parse_args builds its parser once here (the walk parses about a thousand command lines)."""
    import megalite.config.arguments as arguments

    parser = build_parser()
    monkeypatch.setattr(arguments, "build_parser", lambda: parser)


def _check(flag: str, key: str, domain: Domain, kind: type, probe: str, outcome: tuple[str, str]) -> None:
    status, message = outcome
    value = _value(probe, kind)
    rule = domain.describe(kind is int)
    if _admitted(domain, value, kind):
        assert f"{flag} must be" not in message, (probe, message)  # never refused by its own domain
        assert rule in HELP[key], (flag, HELP[key])  # the help states the domain ...
        if domain.off is not None and value == domain.off:
            assert domain.off_means in HELP[key]  # ... and what the off value does
        return
    assert status != "ok", f"{flag}={probe} passed though outside {rule}"
    assert flag in message or f"'{key}'" in message, (probe, message)
    if status == "config":
        assert f"{flag} must be {rule}, got" in message, message  # the domain check, first and alone


def test_every_numeric_field_declares_a_domain():
    """A new int or float field without domain=... fails here (and the parser refuses to build)."""
    missing = []
    for cls, f, _, _ in FIELDS:
        try:
            field_domain(cls, f)
        except TypeError as e:
            missing.append(str(e))
    assert not missing, missing
    assert len(CONFIG_FIELDS) >= 70  # the walk really sees the config sections


@pytest.mark.parametrize("cls, f, kind, is_list", CONFIG_FIELDS, ids=[flag_name(x[1]) for x in CONFIG_FIELDS])
def test_flag_values_outside_the_domain_are_named(cls, f, kind, is_list, one_parser):
    domain, flag = field_domain(cls, f), flag_name(f)
    for probe in PROBES:
        _check(flag, f.name, domain, kind, probe, _run([f"{flag}={_text(probe, kind)}"]))


YAML = {"nan": ".nan", "inf": ".inf", "-inf": "-.inf", "-1": "-1", "0": "0"}


@pytest.mark.parametrize("cls, f, kind, is_list", CONFIG_FIELDS, ids=[flag_name(x[1]) for x in CONFIG_FIELDS])
def test_config_file_values_outside_the_domain_are_named(cls, f, kind, is_list, tmp_path, one_parser):
    domain, flag = field_domain(cls, f), flag_name(f)
    for probe in PROBES:
        text = YAML.get(probe) or ("4611686018427387904" if kind is int else "1.0e+30")
        path = tmp_path / f"{probe}.yaml"
        base = "" if f.name == "vocab_size" else "vocab_size: 64\n"  # the file alone, not BASE (flags win)
        path.write_text(f"mock_data: true\n{base}{f.name}: {'[' + text + ']' if is_list else text}\n")
        _check(flag, f.name, domain, kind, probe, _run(["--config", str(path)], base=[]))


@pytest.mark.parametrize("argv, fragment", [
    (["--moe-expert-capacity-factor", "nan"], "--moe-expert-capacity-factor must be a finite number"),
    (["--moe-expert-capacity-factor", "inf"], "--moe-expert-capacity-factor must be a finite number"),
    (["--clip-grad", "nan"], "--clip-grad must be a finite number > 0, or 0 (0 disables clipping), got nan"),
    (["--adam-eps", "inf"], "--adam-eps must be a finite number in (0, 1], got inf"),
    (["--initial-loss-scale", "inf"], "--initial-loss-scale must be a finite number"),
    (["--min-lr", "nan"], "--min-lr must be a finite number >= 0 that fp32 holds (0, or 1.2e-38 to 3.4e38 in "
                          "size), got nan"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number >= 0, got nan"),
    (["--seed", "-1"], "--seed must be an integer in [0, "),
    (["--hidden-size", "-8", "--tensor-model-parallel-size", "2"], "--hidden-size must be an integer in [1, "),
    (["--ffn-hidden-size", "-8", "--tensor-model-parallel-size", "2"], "--ffn-hidden-size must be an integer"),
    (["--moe-layer-freq", "[0]*2"], "--moe-layer-freq '[0]*2' makes none of the 2 layers (--num-layers) an MoE"),
    (["--moe-ffn-hidden-size", "0"], "--moe-ffn-hidden-size must be an integer in [1, "),
    (["--exit-interval", "-1"], "--exit-interval must be an integer in [1, "),
    (["--exit-interval", "0"], "--exit-interval must be an integer in [1, "),
    (["--hidden-size", "64", "--num-attention-heads", "128"], "(its default is --hidden-size / --num-attention-heads)"),
])
def test_issue_examples_get_named_errors(argv, fragment):
    moe = ["--num-experts", "4", "--disable-bias-linear"]
    status, message = _run(moe + argv)
    assert status == "config" and fragment in message, message
    assert len(message.splitlines()) == 2 or "--hidden-size" in argv, message  # one rule, nothing derived


def test_deepspeed_json_values_go_through_the_same_domain_check(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 2, "gradient_clipping": NaN, '
                    '"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "eps": Infinity}}}')
    status, message = _run(["--deepspeed-config", str(path)])
    assert status == "config", message
    assert "--clip-grad must be a finite number > 0, or 0 (0 disables clipping), got nan" in message
    assert "--adam-eps must be a finite number in (0, 1], got inf" in message


def test_checkpoint_metadata_and_the_offline_writer_go_through_the_domain_check(tmp_path):
    with pytest.raises(CheckpointError, match="--hidden-size must be an integer"):
        model_config({"hidden_size": -8, "num_attention_heads": 2, "vocab_size": 10})
    from megalite.checkpointing.writer import write_checkpoint  # the resharder's and the HF import's writer

    config = {"vocab_size": 10, "num_layers": 2, "hidden_size": 8, "num_attention_heads": 2}
    with pytest.raises(ValueError, match=r"--tensor-model-parallel-size must be an integer in \[1, \d+\], got -2$"):
        write_checkpoint(str(tmp_path / "out"), config, None, tp=-2, pp=1)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, fragment", [
    (["--vocab-size", "0"], "--vocab-size must be an integer in [1, "),
    (["--peak-tflops", "inf"], "--peak-tflops must be a finite number"),
    (["--gpu-memory-gb", "nan"], "--gpu-memory-gb must be a finite number"),
    (["--num-nodes", "-1", "--search"], "--num-nodes must be an integer"),
    (["--clip-grad", "nan", "--search"], "--clip-grad must be a finite number"),
    (["--top", "-1", "--search"], "argument --top: must be an integer in [1, "),
])
def test_planner_refuses_values_outside_their_domain(argv, fragment, capsys):
    try:
        rc = plan_main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    assert fragment in capsys.readouterr().err


# --- the entry points: --help of each, and every numeric option of their own -----------------------------

ENTRY_POINTS = [ROOT / "pretrain_gpt.py", ROOT / "tasks" / "main.py", *sorted((ROOT / "tools").glob("*.py"))]


def _load(path: Path):
    name = "entry_" + "_".join(path.relative_to(ROOT).with_suffix("").parts)
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _exit_code(fn, argv) -> int:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            rc = fn(argv)
        except SystemExit as e:
            rc = e.code
    assert "usage" in out.getvalue().lower(), out.getvalue()[:200]
    return rc or 0


@pytest.mark.parametrize("path", ENTRY_POINTS, ids=[p.name if p.parent == ROOT else f"{p.parent.name}/{p.name}"
                                                     for p in ENTRY_POINTS])
def test_every_entry_point_prints_its_help(path):
    main = _load(path).main
    assert _exit_code(main, ["--help"]) == 0
    if path.name == "pretrain_gpt.py":
        assert _exit_code(main, ["--dry-run", "--help"]) == 0
    if path.name == "convert_checkpoint.py":
        for command in ("reshard", "to-hf", "from-hf"):
            assert _exit_code(main, [command, "--help"]) == 0


class _Captured(Exception):
    pass


def _parsers(path: Path) -> list[argparse.ArgumentParser]:
    """Every parser the entry point builds before it parses (its subcommands' included)."""
    seen: list[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.parse_known_args

    def capture(self, args=None, namespace=None):
        seen.append(self)
        raise _Captured

    argparse.ArgumentParser.parse_known_args = capture
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            _load(path).main(["--search"] if path.name == "plan.py" else [])
    except (_Captured, SystemExit):
        pass
    finally:
        argparse.ArgumentParser.parse_known_args = original
    subs = [p for parser in seen for a in parser._actions if isinstance(a, argparse._SubParsersAction)
            for p in a.choices.values()]
    return seen + subs


CONFIG_DESTS = {f.name for cls in CLASSES for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("path", ENTRY_POINTS, ids=[p.name for p in ENTRY_POINTS])
def test_entry_point_numeric_options_declare_and_enforce_a_domain(path):
    parsers = _parsers(path)
    assert parsers, f"{path.name}: no parser captured"
    for parser in parsers:
        for action in parser._actions:
            flag = action.option_strings[-1] if action.option_strings else action.dest
            if action.type in (int, float):
                assert action.dest in CONFIG_DESTS, f"{path.name} {flag}: a number without a declared domain"
                continue
            if not isinstance(action.type, DomainType):
                continue
            kind = int if action.type.integer else float
            for probe in PROBES:
                value = _value(probe, kind)
                try:
                    action.type(_text(probe, kind))
                    ok = True
                except (argparse.ArgumentTypeError, ValueError):
                    ok = False
                assert ok == _admitted(action.type.domain, value, kind), (path.name, flag, probe)
                if ok:
                    assert action.type.domain.describe(action.type.integer) in action.help, (flag, action.help)
            err = io.StringIO()
            with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
                parser.parse_known_args([f"{flag}=nan"])
            assert f"argument {flag}" in err.getvalue() or flag in err.getvalue(), err.getvalue()


def test_domain_describes_and_refuses_every_class_of_bad_number():
    clip = Domain(lo=0, lo_open=True, off=0, off_means="disables clipping")
    assert clip.describe(False) == "a finite number > 0, or 0 (0 disables clipping)"
    assert [clip.admits(v) for v in (0, 1e-3, 1e30)] == [True, True, True]
    assert not any(clip.admits(v) for v in (math.nan, math.inf, -math.inf, -1))
    size = Domain(lo=1, hi=8)
    assert size.error("--x", -8, True) == "--x must be an integer in [1, 8], got -8"
    assert size.error("--x", True, True) and size.error("--x", 2.0, True)  # a bool or a float is no integer
