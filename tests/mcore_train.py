"""megatron-core trained on the CPU for the optimizer-state imports, and its optimizer's own state per parameter.

``train_gpt`` builds megatron-core's GPTModel at the parallel state already initialised (TP, PP, model
chunks with interleaving, EP: tests/mcore_cpu.py's shims and models), wraps every chunk in its
DistributedDataParallel and trains it with ``get_megatron_optimizer`` (its ChainedOptimizer of dense and
expert optimizers at EP > 1), the pipeline run by hand: virtual stage c·PP + p is chunk c of stage p, the
activations passed rank to rank forward and their gradients back, then ``finalize_model_grads`` (DP
reduction and the tied embedding's all-reduce between the first and last stage) as Megatron-LM's training
loop calls it. ``optimizer_records`` lists this rank's optimizer state per parameter under global layer and
expert numbers, and ``reference_state`` joins every rank's records into full tensors.
"""

from __future__ import annotations

import re

import torch

OPTIMIZER = dict(optimizer="adam", lr=1e-3, weight_decay=0.1, clip_grad=0.0, bf16=False, fp16=False)
# Megatron-LM's training loop saves with this metadata (and the distributed optimizer's sharding type)
MEGATRON_LM_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def pipeline_step(chunks: list, ddps: list, tokens: torch.Tensor) -> None:
    """One forward and backward of the logits' square mean through every stage and chunk of the pipeline."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    pp, me = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    prev, nxt = ps.get_pipeline_model_parallel_prev_rank(), ps.get_pipeline_model_parallel_next_rank()
    b, s = tokens.shape
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
    stages, inputs, outputs = pp * len(chunks), {}, {}
    mine = [v for v in range(stages) if v % pp == me]
    for v in mine:
        chunk = chunks[v // pp]
        if v > 0:
            inputs[v] = torch.empty(s, b, chunk.config.hidden_size)
            dist.recv(inputs[v], src=prev)
            chunk.set_input_tensor(inputs[v].requires_grad_())
        outputs[v] = ddps[v // pp](tokens, torch.arange(s).expand(b, s), mask)
        if v < stages - 1:
            dist.send(outputs[v].detach().contiguous(), dst=nxt)
    for v in reversed(mine):
        if v == stages - 1:
            outputs[v].square().mean().backward()
        else:
            grad = torch.empty_like(outputs[v])
            dist.recv(grad, src=nxt)
            outputs[v].backward(grad)
        if v > 0:
            dist.send(inputs[v].grad.contiguous(), dst=prev)


def train_gpt(args, distributed: bool, steps: int, tokens: torch.Tensor, tp: int, pp: int = 1, ep: int = 1,
              vp: int | None = None, **ddp_options) -> tuple[list, object]:
    """megatron-core's model chunks on this rank and their optimizer after ``steps`` steps (``ddp_options``:
    DistributedDataParallelConfig's, e.g. overlapped gradient reduction and its bucket size)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from tests.mcore_cpu import build_gpt

    stages = [None] if vp is None else list(range(vp))
    chunks = [build_gpt(args, tp=tp, pp=pp, ep=ep, vp_stage=c, vp=vp).train() for c in stages]
    config = DistributedDataParallelConfig(use_distributed_optimizer=distributed, **ddp_options)
    ddps = [DistributedDataParallel(m.config, config, m, disable_bucketing=i > 0) for i, m in enumerate(chunks)]
    opt = get_megatron_optimizer(OptimizerConfig(**OPTIMIZER, use_distributed_optimizer=distributed), ddps)
    for _ in range(steps):
        for ddp in ddps:
            ddp.zero_grad_buffer()
        opt.zero_grad()
        pipeline_step(chunks, ddps, tokens)
        finalize_model_grads(ddps)
        assert opt.step()[0]
    return chunks, opt


def _global_name(name: str, layer_offset: int, expert_offset: int) -> str:
    name = re.sub(r"^decoder\.layers\.(\d+)", lambda m: f"decoder.layers.{int(m[1]) + layer_offset}", name)
    return re.sub(r"local_experts\.(\d+)", lambda m: f"local_experts.{int(m[1]) + expert_offset}", name)


def optimizer_records(chunks: list, opt, args) -> list[tuple]:
    """This rank's optimizer state, one record per parameter it holds state of: (global name, TP rank, cut
    dim or -1, local shape, start in the flattened parameter, {exp_avg, exp_avg_sq, main: flat}, step). The
    distributed optimizer keeps this DP rank's slice of each parameter it owns (its own main parameter);
    the plain one the whole (its main parameter is the fp32 weight)."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    experts = (ps.get_expert_model_parallel_rank() * (getattr(args, "num_experts", None) or 0)
               // ps.get_expert_model_parallel_world_size())
    out = []
    for c, chunk in enumerate(chunks):
        offset = get_transformer_layer_offset(chunk.config, c if len(chunks) > 1 else None)
        for name, p in chunk.named_parameters():
            expert = not getattr(p, "allreduce", True)
            tp = ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank()
            dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else -1
            for o in getattr(opt, "chained_optimizers", [opt]):
                if isinstance(o, DistributedOptimizer) and p in o.model_param_gbuf_map:
                    state = o._get_main_param_and_optimizer_states(p)
                    start, main = o._get_model_param_range_map(p)["param"].start, state["param"]
                elif not isinstance(o, DistributedOptimizer) and p in o.optimizer.state:
                    state, start, main = o.optimizer.state[p], 0, p
                else:
                    continue
                fields = {"exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"], "main": main}
                out.append((_global_name(name, offset, experts), tp, dim, tuple(p.shape), start,
                            {k: v.detach().flatten().clone() for k, v in fields.items()}, float(state["step"])))
    return out


def _assemble(parts: list[tuple[int, torch.Tensor]], shape: tuple[int, ...], where: str) -> torch.Tensor:
    """One TP rank's parameter from its flat slices (DP ranks' disjoint ones, or equal replicas)."""
    flat, seen = torch.zeros(torch.Size(shape).numel()), torch.zeros(torch.Size(shape).numel(), dtype=torch.bool)
    for start, t in parts:
        span = slice(start, start + t.numel())
        overlap = seen[span]
        assert torch.equal(flat[span][overlap], t[overlap]), f"{where}: replicas differ"
        flat[span], seen[span] = t, True
    assert seen.all(), f"{where}: not every element has optimizer state"
    return flat.view(shape)


def reference_state(records: list[tuple], swiglu: bool) -> tuple[dict[str, dict[str, torch.Tensor]], set]:
    """field -> global megatron-core name -> the full tensor, from every rank's records: DP slices put in
    place, TP shards joined on their cut dim (SwiGLU's fc1 as [gate; up]); and the steps seen."""
    by_name: dict[str, dict[int, list]] = {}
    for name, tp, dim, shape, start, fields, _ in records:
        by_name.setdefault(name, {}).setdefault(tp, []).append((dim, shape, start, fields))
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, per_tp in by_name.items():
        dim, shape = per_tp[0][0][:2]
        for field in ("exp_avg", "exp_avg_sq", "main"):
            shards = [_assemble([(r[2], r[3][field]) for r in per_tp[t]], shape, f"{name} {field}")
                      for t in sorted(per_tp)]
            out.setdefault(field, {})[name] = _join(shards, dim, swiglu and "linear_fc1" in name)
    return out, {r[-1] for r in records}


def _join(shards: list[torch.Tensor], dim: int, gated: bool) -> torch.Tensor:
    if dim < 0:
        assert all(torch.equal(t, shards[0]) for t in shards)
        return shards[0]
    if gated:
        halves = [t.chunk(2) for t in shards]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    return torch.cat(shards, dim=dim)
