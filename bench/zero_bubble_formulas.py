"""Closed forms for the zero-bubble figures (docs/design.md §3.4, bench/README.md "Zero-bubble schedules").

Bubble sizes per rank (idle time in a step) from Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024,
Table 2, with F, B, W one stage's forward, input-gradient backward and weight-gradient times:
1F1B (p − 1)(F + B + W), ZB-H1 (p − 1)(F + B − W), ZB-H2 (p − 1)(F + B − 2W); interleaved 1F1B is 1F1B's
divided by v. Bytes kept per pending W: what each deferred GEMM of tensor_parallel/weight_grad.py keeps.
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


def deferred_w_bytes(s: int, b: int, h: int, ffn: int, tp: int = 1, layers: int = 1, *, sp: bool = False,
                     elt: int = 4, qkv: int | None = None, swiglu: bool = False) -> int:
    """Bytes one pending W keeps on a stage of ``layers`` transformer layers: each deferred linear keeps
    its output gradient and its input (with sequence parallelism a column-parallel layer keeps the input's
    local sequence shard and gathers it again in W; a row-parallel layer's output gradient is the gathered
    [s, b, h]). ``qkv``: the fused QKV width (default 3h; with query groups h + 2·groups·head_dim);
    ``swiglu``: fc1 is [gate; up], 2·ffn wide. Per layer, in elements of s·b:

        QKV   in h (h/tp with SP)   + out grad qkv/tp
        proj  in h/tp               + out grad h
        fc1   in h (h/tp with SP)   + out grad ffn/tp (2·ffn/tp with SwiGLU)
        fc2   in ffn/tp             + out grad h

    i.e. 4h + (qkv + h + 2·ffn)/tp without SP, 2h + (qkv + 3h + 2·ffn)/tp with SP (qkv = 3h, no SwiGLU)."""
    qkv = 3 * h if qkv is None else qkv
    col_in = h // tp if sp else h
    fc1_out = (2 if swiglu else 1) * ffn
    per_token = (col_in + qkv // tp) + (h // tp + h) + (col_in + fc1_out // tp) + (ffn // tp + h)
    return s * b * per_token * layers * elt


def output_layer_w_bytes(s: int, b: int, h: int, vocab: int, tp: int = 1, *, sp: bool = False, elt: int = 4) -> int:
    """The last stage's extra per pending W with the unfused output layer: its input [s, b, h] (the local
    shard with SP) and the logits' gradient [s, b, vocab/tp] (``vocab`` padded)."""
    return s * b * ((h // tp if sp else h) + vocab // tp) * elt
