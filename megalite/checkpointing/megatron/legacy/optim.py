"""Megatron-LM's legacy-format optimizer state (``optimizer`` in each ``model_optim_rng.pt``) by parameter name.

Megatron-LM saves the rank's optimizer ``state_dict()``: torch's layout, where each parameter is a number
counted over the parameter groups in order (``param_groups[g]['params']``), with ``state[i]`` holding
Adam's ``step``, ``exp_avg`` and ``exp_avg_sq``; a bf16/fp16 run wraps it as ``{'optimizer': ...,
'fp32_from_fp16_params': [[...] per group]}``. The numbers follow megatron-core's default grouping: the
rank's parameters in ``named_parameters()`` order (the saved model state dict's order, buffers left out),
put into groups by weight decay (none for biases and 1-D tensors) in the order each group first appears.
That grouping is rebuilt here and checked against the saved groups' sizes and every tensor's shape; a
state that does not fit it (another grouping, the chained dense and expert optimizers of an MoE run) is not
read, and the reason is returned. The distributed optimizer's state (``distrib_optim.pt``) is
legacy/distrib_optim.py's.
"""

from __future__ import annotations

from typing import Any

import torch

from megalite.checkpointing.megatron.names import BUFFERS

FIELDS = ("exp_avg", "exp_avg_sq")


def _no_weight_decay(name: str, shape: torch.Size) -> bool:
    return name.endswith(".bias") or len(shape) == 1


def _ordered_params(chunks: list[dict[str, torch.Tensor]]) -> tuple[list[tuple[int, str, torch.Tensor]], list[int]]:
    """(chunk, name, tensor) of every parameter, numbered as megatron-core's default groups number them,
    and the groups' sizes."""
    params = [(c, k, t) for c, sd in enumerate(chunks) for k, t in sd.items() if not BUFFERS.search(k)]
    groups: dict[bool, list[tuple[int, str, torch.Tensor]]] = {}
    for item in params:
        groups.setdefault(_no_weight_decay(item[1], item[2].shape), []).append(item)
    return [item for group in groups.values() for item in group], [len(g) for g in groups.values()]


def legacy_moments(saved: Any, chunks: list[dict[str, torch.Tensor]]
                   ) -> tuple[list[dict[str, dict[str, torch.Tensor]]], float] | str:
    """Per model chunk: field (exp_avg, exp_avg_sq, main) -> parameter name -> this rank's tensor, and
    Adam's step; or why the saved optimizer state is not read."""
    inner, fp32 = (saved.get("optimizer"), saved.get("fp32_from_fp16_params")) if isinstance(saved, dict) and \
        "optimizer" in saved else (saved, None)
    if not isinstance(inner, dict) or not isinstance(inner.get("state"), dict) or \
            not isinstance(inner.get("param_groups"), list):
        return "its optimizer state is not one torch optimizer's state_dict (the distributed or a chained optimizer)"
    order, expected = _ordered_params(chunks)
    sizes = [len(g.get("params", [])) for g in inner["param_groups"] if isinstance(g, dict)]
    if sizes != expected:
        return (f"its optimizer's parameter groups hold {sizes} parameters, megatron-core's default grouping of "
                f"the model file's would hold {expected}")
    out: list[dict[str, dict[str, torch.Tensor]]] = [{} for _ in chunks]
    steps = set()
    mains = [t for group in fp32 for t in group] if isinstance(fp32, list) else None
    for i, (c, name, param) in enumerate(order):
        state = inner["state"].get(i)
        if not isinstance(state, dict):
            return f"its optimizer holds no state for parameter {i} ({name})"
        for field in FIELDS:
            t = state.get(field)
            if not isinstance(t, torch.Tensor) or t.shape != param.shape:
                return f"its optimizer's {field} of parameter {i} does not have {name}'s shape {tuple(param.shape)}"
            out[c].setdefault(field, {})[name] = t
        if mains is not None:
            out[c].setdefault("main", {})[name] = mains[i]
        steps.add(float(state.get("step", -1)))
    if len(steps) != 1 or min(steps) < 0:
        return f"its optimizer's step counts differ between parameters ({sorted(steps)[:4]})"
    return out, steps.pop()
