"""Closed forms of the zero-bubble bubbles (docs/design.md §3.4, bench/README.md "Zero-bubble schedules").

Bubble sizes per rank (idle time in a step) from Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024,
Table 2, with F, B, W one stage's forward, input-gradient backward and weight-gradient times:
1F1B (p − 1)(F + B + W), ZB-H1 (p − 1)(F + B − W), ZB-H2 (p − 1)(F + B − 2W); interleaved 1F1B is 1F1B's
divided by v. The bytes a pending W keeps: megalite/planning/zero_bubble.py.
"""

from __future__ import annotations


def paper_bubble(name: str, p: int, f: float, b: float, w: float, v: int = 2) -> float | None:
    """Idle time per rank the formulas give (stage times; None where the paper gives no closed form)."""
    if name == "1f1b":
        return (p - 1) * (f + b + w)
    if name == "interleaved":
        return (p - 1) * (f + b + w) / v
    if name == "zb-h1":
        return (p - 1) * (f + b - w)
    return None
