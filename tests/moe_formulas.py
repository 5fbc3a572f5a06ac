"""Bytes the MoE token dispatch hands to collectives, per MoE layer and micro-batch (docs/moe.md, "Bytes").

Pure arithmetic, keyed like ``ProcessGroups.comm_bytes`` ((group kind, label) -> bytes), so a bench can
compare it with a real run's counters. Dropless routing: every one of a rank's T tokens makes k
assignments, so the bytes are determined. Without padding the alltoall dispatcher's rows per rank depend
on where the tokens went (a rank sends its T·k rows, but receives the rows its experts were chosen for),
so its figures are sums over all ranks; the allgather dispatcher's are the same on every rank.
"""

from __future__ import annotations

from collections import Counter

INT64, BOOL, FP32 = 8, 1, 4


def alltoall_bytes(T: int, h: int, k: int, E: int, ep: int, etp: int, world: int, elt: int,
                   padded_rows: int | None = None) -> Counter:
    """Sum over the ``world`` ranks (each with T tokens of h x ``elt`` bytes) of one layer's forward and
    backward. ``padded_rows``: with --moe-pad-expert-input-to-capacity each rank sends E x capacity rows
    instead of its T x k.

    - ("ep", "moe_counts"): each rank's assignment count per expert, E int64 (forward only).
    - ("ep", "moe_all_to_all"): dispatch sends each rank's rows once, combine sends every row back once;
      backward sends their gradients the same two ways: 4 x rows x h x elt in all.
    - ("etp", "moe_routing_all_gather"): the received counts [ep, E/ep] gathered over expert-TP: etp x E int64.
    - ("etp", "moe_all_to_all"): every received row goes to each of the etp ranks (etp copies), and the etp
      partial sums come back; again in backward: 4 x etp x rows x h x elt over the world.
    """
    rows = world * (padded_rows if padded_rows is not None else T * k)
    out: Counter = Counter()
    if ep > 1:
        out[("ep", "moe_counts")] = world * E * INT64
        out[("ep", "moe_all_to_all")] = 4 * rows * h * elt
    if etp > 1:
        out[("etp", "moe_routing_all_gather")] = world * etp * E * INT64
        out[("etp", "moe_all_to_all")] = 4 * etp * rows * h * elt
    return out


def allgather_bytes(T: int, h: int, k: int, ep: int, etp: int, elt: int) -> Counter:
    """One rank's bytes (the same on each) for one layer's forward and backward, G = etp x ep ranks:

    - ("emp", "moe_all_gather"): the G x T tokens gathered (counted as the gathered output) and their
      gradients reduce-scattered back; the same for the fp32 routing weights [T, k]: 2 G T (h elt + 4 k).
    - ("emp", "moe_routing_all_gather"): expert ids (int64) and kept flags (bool) [T, k], forward only.
    - ("emp", "moe_reduce_scatter"): the weighted sums of all G x T tokens reduce-scattered (counted as the
      input), gradients all-gathered in backward: 2 G T h elt.
    """
    G = ep * etp
    out: Counter = Counter()
    if G > 1:
        out[("emp", "moe_all_gather")] = 2 * G * T * (h * elt + k * FP32)
        out[("emp", "moe_routing_all_gather")] = G * T * k * (INT64 + BOOL)
        out[("emp", "moe_reduce_scatter")] = 2 * G * T * h * elt
    return out


def step_bytes(per_layer: Counter, moe_layers: int, microbatches: int) -> Counter:
    """Per-layer, per-micro-batch figures times the MoE layers and the micro-batches of a step."""
    return Counter({key: v * moe_layers * microbatches for key, v in per_layer.items()})
