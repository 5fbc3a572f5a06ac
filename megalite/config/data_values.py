"""The numbers written inside data strings: ``--split 969,30,1`` and the blend weights of ``--data-path``,
``--train-data-path``, ``--valid-data-path`` and ``--test-data-path`` ('0.7 a 0.3 b'), on the command line or
in a --config file. Each piece is parsed as a whole number by ``float`` and checked against its domain, so
'nan', 'inf', '-1' or '1,,2' are named instead of dropped (a regular expression picking digits out of the
text kept '1' of '-1') or carried into the sample counts (NaN weights end in a traceback).

Both are checked when the config is validated, before any file is opened; the dataset builder parses the
same way (megalite.data.builder).
"""

from __future__ import annotations

import math

DATA_PATH_FLAGS = ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path")


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def split_proportions(split: str) -> list[float]:
    """'969,30,1' (or '969/30/1', as Megatron-LM) -> normalised train/valid/test proportions; missing
    trailing entries are 0. Raises ValueError naming the entry that is not a finite number >= 0."""
    text = split.strip()
    sep = "," if "," in text or "/" not in text else "/"
    parts = [p.strip() for p in text.split(sep)]
    if len(parts) > 3:
        sep_name = "comma" if sep == "," else "'/'"
        raise ValueError(f"--split {split!r}: expected up to three {sep_name}-separated proportions (train, valid, "
                         f"test), got {len(parts)}")
    values = []
    for i, part in enumerate(parts):
        which = ("train", "valid", "test")[i]
        value = _number(part)
        if value is None:
            got = "nothing" if not part else repr(part)
            raise ValueError(f"--split {split!r}: the {which} proportion must be a finite number >= 0, got {got}")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"--split {split!r}: the {which} proportion must be a finite number >= 0, got {part}")
        values.append(value)
    values += [0.0] * (3 - len(values))
    total = sum(values)
    if total <= 0:
        raise ValueError(f"--split {split!r}: proportions must not all be zero")
    if not math.isfinite(total):
        raise ValueError(f"--split {split!r}: the proportions' sum overflows; write smaller numbers")
    return [v / total for v in values]


def blend_weights(values: list[str] | None, flag: str) -> tuple[list[str], list[float] | None] | None:
    """``['a']`` / ``['a', 'b']`` -> prefixes without weights; ``['0.7', 'a', '0.3', 'b']`` -> weighted.
    A word that parses as a number ('nan', 'inf', '-1' included) is a weight: it must be finite and > 0.
    Raises ValueError naming ``flag`` and the weight."""
    if not values:
        return None
    values = [v.strip() for v in values]
    if len(values) % 2 == 0:
        weights = [_number(v) for v in values[0::2]]
        if all(w is not None for w in weights):
            for text, w, prefix in zip(values[0::2], weights, values[1::2]):
                if not math.isfinite(w) or w <= 0:
                    raise ValueError(f"{flag}: the blend weight of {prefix!r} must be a finite number > 0, "
                                     f"got {text}")
            if not math.isfinite(sum(weights)):
                raise ValueError(f"{flag}: the blend weights' sum overflows; write smaller weights")
            return values[1::2], weights
        if any(w is not None for w in weights):
            raise ValueError(f"{flag}: give either prefixes only or 'weight prefix' pairs, got {values}")
    for v in values:
        if _number(v) is not None:
            raise ValueError(f"{flag}: {v!r} looks like a weight but weights need one prefix each: {values}")
    return values, None


def data_string_errors(data_path: list[str] | None, per_split: list[list[str] | None], split: str) -> list[str]:
    """Every error in the numbers of the data flags (used by config validation)."""
    errors = []
    for flag, values in zip(DATA_PATH_FLAGS, [data_path, *per_split]):
        try:
            blend_weights(values, flag)
        except ValueError as e:
            errors.append(str(e))
    try:
        split_proportions(split)
    except ValueError as e:
        errors.append(str(e))
    return errors
