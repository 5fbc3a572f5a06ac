"""--pipeline-model-parallel-layout's string (Megatron-LM's syntax) read into every virtual stage's layer count.

Stages are separated by ``|`` and listed in pipeline order (round-robin: chunk 0 of every rank, then chunk 1
...; ZB-V: down the V and back up). ``E`` is the embedding, ``t`` a transformer layer, ``L`` the loss;
``x*N`` repeats a symbol and ``(...)*N`` a group (stage separators included); commas are cosmetic and
empty stages are legal, e.g. ``E|t*3|t*3|tL`` or ``E|(tt|)*2,t|L``. megalite has no MTP layer, so ``m``
is refused, and the embedding must open the first stage's symbols and the loss close the last's.
"""

from __future__ import annotations

import re

FLAG = "--pipeline-model-parallel-layout"
MAX_REPEAT = 100_000  # past any model's depth: a typo, refused before the string is built
_REPEAT = re.compile(r"\(([^()]*)\)\*(\d+)|([EtLm])\*(\d+)")


def _expand(text: str) -> str:
    """The string with every repetition written out (innermost groups first)."""
    while True:
        match = _REPEAT.search(text)
        if match is None:
            return text
        body, times = (match[1], match[2]) if match[1] is not None else (match[3], match[4])
        if int(times) > MAX_REPEAT:
            raise ValueError(f"{FLAG}: repeat count {times} exceeds {MAX_REPEAT}")
        # the length is checked before the string is built: nested repeats multiply ("((t)*99999)*99999")
        if len(text) - (match.end() - match.start()) + len(body) * int(times) > 10 * MAX_REPEAT:
            raise ValueError(f"{FLAG}: the layout expands past {10 * MAX_REPEAT} symbols")
        text = text[:match.start()] + body * int(times) + text[match.end():]


def parse_layout(text: str) -> tuple[int, ...]:
    """Transformer layers of every stage of ``text``; ValueError (one line naming the flag and the rule)
    when it is not a layout megalite can build."""
    expanded = _expand(text.replace(",", "").replace(" ", ""))
    bad = sorted(set(re.sub(r"[*()0-9]", "", expanded)) - set("EtL|"))
    if "m" in bad:
        raise ValueError(f"{FLAG} {text!r}: m (an MTP layer) is not supported: megalite has no "
                         "multi-token-prediction layers")
    if bad:
        raise ValueError(f"{FLAG} {text!r}: unknown symbol {bad[0]!r} (use E, t, L, |, x*N, (...)*N and commas)")
    if set(expanded) - set("EtL|"):
        raise ValueError(f"{FLAG} {text!r}: a repeat is x*N or (...)*N with N a number (parentheses paired)")
    stages = expanded.split("|")
    if len(stages) < 2:
        raise ValueError(f"{FLAG} {text!r}: needs at least two stages separated by |")
    if stages[0].count("E") != 1 or expanded.count("E") != 1 or not stages[0].startswith("E"):
        raise ValueError(f"{FLAG} {text!r}: the embedding E must open the first stage, once")
    if stages[-1].count("L") != 1 or expanded.count("L") != 1 or not stages[-1].endswith("L"):
        raise ValueError(f"{FLAG} {text!r}: the loss L must close the last stage, once")
    return tuple(s.count("t") for s in stages)
