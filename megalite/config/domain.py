"""The domain of a numeric flag, declared once where the flag is (a config field's ``option(domain=...)``,
or a tool's own option through ``domain_type``), and the one check every entry point runs against it.

Written case by case, range rules miss whole classes of values: NaN passes ``x <= 0`` (every comparison
with NaN is false), inf passes "positive", a negative size passes "divisible by TP" (-8 % 2 == 0). A
domain states them all at once: a finite number (ints always are), inclusive or exclusive bounds, and at
most one "off" value outside the regular range whose meaning the flag's help states (0 disables
clipping, as in Megatron-LM). Every rule that combines flags sees only values already in their domain.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from typing import Any

MAX_SIZE = 2**30  # a model dimension, batch size or vocabulary past this is a typo (and no device holds it)
MAX_HIDDEN = 2**26  # so that the derived sizes (4h FFN, h / heads) stay below MAX_SIZE
MAX_RANKS = 2**20  # a parallel size, node or GPU count
MAX_COUNT = 2**53  # iterations, samples, intervals: every integer up to here is exact in a float
FP32_MAX = 3.4028234663852886e38  # the largest finite fp32 number
FP32_TINY = 1.1754943508222875e-38  # the least normal fp32 number: below it a value is 0 or denormal in fp32


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


@dataclass(frozen=True)
class Domain:
    """Where a number lies: finite, within [lo, hi] (either end open or absent), or exactly ``off``."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    off: float | None = None  # one value outside [lo, hi] that switches the feature off
    off_means: str = ""  # what ``off`` does, as the help states it: "disables clipping"
    fp32: bool = False  # the value ends up in an fp32 tensor: it must be 0 or a normal fp32 number there

    def admits(self, value: float) -> bool:
        if self.off is not None and value == self.off:
            return True
        if not math.isfinite(value):
            return False
        if self.fp32 and value != 0 and not FP32_TINY <= abs(value) <= FP32_MAX:
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)

    def describe(self, integer: bool) -> str:
        """'a finite number > 0, or 0 (disables clipping)': the rule as the help and the errors say it."""
        kind = "an integer" if integer else "a finite number"
        lo, hi = self.lo, self.hi
        if lo is not None and hi is not None:
            text = f"{kind} in {'(' if self.lo_open else '['}{_num(lo)}, {_num(hi)}{')' if self.hi_open else ']'}"
        elif lo is not None:
            text = f"{kind} {'>' if self.lo_open else '>='} {_num(lo)}"
        elif hi is not None:
            text = f"{kind} {'<' if self.hi_open else '<='} {_num(hi)}"
        else:
            text = kind
        if self.fp32:
            zero = replace(self, off=None).admits(0.0)  # 0 in the regular range (an off value is said below)
            text += f" that fp32 holds ({'0, or ' if zero else ''}1.2e-38 to 3.4e38 in size)"
        if self.off is not None:
            text += f", or {_num(self.off)} ({_num(self.off)} {self.off_means})"
        return text

    def error(self, flag: str, value: Any, integer: bool) -> str | None:
        """None when ``value`` is in the domain, else the message naming the flag, the rule and the value."""
        numeric = isinstance(value, int) or (isinstance(value, float) and not integer)
        if isinstance(value, bool) or not numeric or not self.admits(value):
            return f"{flag} must be {self.describe(integer)}, got {value!r}"
        return None


def positive(hi: float | None = None) -> Domain:
    """A finite number (or integer) > 0."""
    return Domain(lo=0, lo_open=True, hi=hi)


def at_least(lo: float, hi: float | None = None) -> Domain:
    return Domain(lo=lo, hi=hi)


def size(hi: float = MAX_SIZE) -> Domain:
    """A count of things that must exist: 1 .. hi."""
    return Domain(lo=1, hi=hi)


def count() -> Domain:
    """Iterations, samples, intervals: 1 .. MAX_COUNT."""
    return Domain(lo=1, hi=MAX_COUNT)


def in_fp32(domain: Domain) -> Domain:
    """``domain`` for a value that ends up in fp32 (a learning rate, a temperature): a value fp32 rounds to
    infinity, or to 0 or a denormal (whose reciprocal overflows), is outside it."""
    return replace(domain, fp32=True)


def fraction(lo_open: bool = False, hi_open: bool = False) -> Domain:
    return Domain(lo=0, hi=1, lo_open=lo_open, hi_open=hi_open)


class DomainType:
    """An argparse ``type=`` that parses an int or a float and refuses a value outside ``domain``;
    argparse names the flag in the error ("argument --top: must be an integer >= 1, got -1")."""

    def __init__(self, domain: Domain, integer: bool) -> None:
        self.domain, self.integer = domain, integer
        self.__name__ = "int" if integer else "float"  # argparse's "invalid int value" names it

    def __call__(self, text: str) -> int | float:
        value = (int if self.integer else float)(text)
        if not self.domain.admits(value):
            raise argparse.ArgumentTypeError(f"must be {self.domain.describe(self.integer)}, got {text}")
        return value


def domain_option(group: Any, *flags: str, domain: Domain, integer: bool, help: str = "", **kw: Any) -> Any:
    """``group.add_argument`` for a tool's own numeric option: the domain checks the value and is
    appended to the help (with the off value's meaning)."""
    text = f"{help} [{domain.describe(integer)}]".strip()
    return group.add_argument(*flags, type=DomainType(domain, integer), help=text, **kw)
