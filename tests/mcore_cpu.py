"""megatron-core on a CPU-only torch, for the Megatron import tests (tests/test_megatron_import.py).

megatron-core is the reference here, never a dependency of megalite. A few of its paths ask CUDA for a
device or an RNG state even when told to initialise on the CPU; ``cpu_shim`` patches exactly those, in
the rank process that calls it:

- ``torch.cuda.current_device``: its global memory buffer (the local attention's matmul input) and the
  save's failure all-reduce allocate on it; here it names the CPU.
- ``Tensor.cuda``: with pipeline stages, the tied output layer's copy is moved to the device before the
  all-reduce that makes it equal to the embedding; here it stays on the CPU.
- ``torch.cuda.synchronize``: the save's pre-load waits for the device; nothing to wait for.
- the torch_dist writer hands its results over a queue of a spawned manager process and writes each
  bucket in a forked child; the test ranks are daemonic (no children allowed) and hold gloo's threads (a
  fork may deadlock on a lock one of them holds). Its result queue becomes an in-process one and the
  buckets are written one after the other in this process (``_write_in_process``), by the writer's own
  per-bucket function. That function logs its memory through psutil, which the tests need not have: 0.
- the MoE router's GEMM tests Transformer Engine's GEMM, a name left undefined when Transformer Engine is
  absent: None here (the plain matmul path).
- the model-parallel RNG tracker's ``fork`` (dropout regions) saves and restores the CUDA RNG; with
  dropout off it draws nothing, so it becomes a plain context.
"""

from __future__ import annotations

import contextlib


def _write_in_process(transforms, use_msc, rank, buckets, results_queue) -> None:
    """The torch_dist writer's multi-process write, bucket by bucket in this process (same results)."""
    import queue

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    local, count, out = queue.Queue(), queue.Queue(), {}
    for i, bucket in enumerate(buckets):
        count.put(i)
        FileSystemWriterAsync.write_preloaded_data(transforms, i, bucket, local, count, True)
        idx, result = local.get()
        if isinstance(result, Exception):
            results_queue.put(result)
            return
        out[idx] = result
    results_queue.put(out)


def cpu_shim() -> None:
    """Patch the CUDA calls megatron-core makes on the CPU (see the module docstring)."""
    import queue

    import torch
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    filesystem_async._results_queue = queue.Queue()
    moe_utils.te_general_gemm = None
    writer = filesystem_async.FileSystemWriterAsync
    writer.write_preloaded_data_multiproc = staticmethod(_write_in_process)
    filesystem_async._process_memory = lambda: 0


class _CpuTorch:
    """torch as seen by megatron-core's optimizer modules: the small buffers they create with
    ``device='cuda'`` (loss scale, norm results, overflow flags) made on the CPU; all else is torch."""

    def __getattr__(self, name: str):
        import torch

        value = getattr(torch, name)
        if name not in ("tensor", "zeros", "empty", "ones", "full"):
            return value

        def on_cpu(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return value(*args, **kwargs)

        return on_cpu


def optimizer_cpu_shim() -> None:
    """megatron-core's optimizers on the CPU: its modules' CUDA buffers on the CPU (its fallback optimizer
    is torch's AdamW; gradient clipping asserts CUDA tensors, so the tests run with ``clip_grad=0``), and
    ``Tensor.type()`` naming CPU tensors as their CUDA kinds, as the distributed optimizer accepts only
    those for its parameters (``torch.cuda.FloatTensor``, ...)."""
    import torch
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    for module in (optimizer, distrib_optimizer, clip_grads, utils):
        module.torch = _CpuTorch()
    plain = torch.Tensor.type

    def cuda_named(self, *args, **kwargs):
        name = plain(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or name.startswith("torch.cuda."):
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_named


# ---- tiny megatron-core models from Megatron-LM's argument names --------------------------------------


def _config(args, tp: int, pp: int, ep: int = 1, vp: int | None = None):
    """megatron-core's TransformerConfig of a Megatron-LM ``args`` Namespace (the subset the cases use) at
    TP ``tp``, PP ``pp`` (``vp`` model chunks per stage) and EP ``ep``."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = {}
    if getattr(args, "num_experts", None):
        moe = dict(num_moe_experts=args.num_experts, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                   moe_router_topk=args.moe_router_topk, moe_token_dispatcher_type="allgather",
                   moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
        for name in ("moe_shared_expert_intermediate_size", "moe_router_score_function",
                     "moe_router_enable_expert_bias", "moe_router_pre_softmax", "moe_router_topk_scaling_factor"):
            if getattr(args, name, None) is not None:  # the router and shared expert the export's args describe
                moe[name] = getattr(args, name)
        if getattr(args, "moe_layer_freq", None) is not None:  # as Megatron-LM copies it: an int or a 0/1 list
            moe["moe_layer_freq"] = args.moe_layer_freq
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels, normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu, activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=args.add_bias_linear, hidden_dropout=0.0, attention_dropout=0.0,
        add_qkv_bias=getattr(args, "add_qkv_bias", False),
        qk_layernorm=getattr(args, "qk_layernorm", False),
        window_size=getattr(args, "window_size", None),
        window_attn_skip_freq=getattr(args, "window_attn_skip_freq", None),
        use_cpu_initialization=True, params_dtype=torch.float32, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, bias_activation_fusion=False,
        virtual_pipeline_model_parallel_size=vp, expert_model_parallel_size=ep,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False, **moe)


def _global_seed(name: str, layer_offset: int, tied: bool, expert_offset: int = 0) -> int:
    """A seed per parameter of the whole model: layer (and local expert) numbers made global, a tied output
    layer (the last stage's copy of the embedding) seeded as the embedding, so the copies stay equal."""
    import re
    import zlib

    if tied and name == "output_layer.weight":
        name = "embedding.word_embeddings.weight"
    name = re.sub(r"decoder\.layers\.(\d+)", lambda m: f"decoder.layers.{int(m[1]) + layer_offset}", name)
    name = re.sub(r"local_experts\.(\d+)", lambda m: f"local_experts.{int(m[1]) + expert_offset}", name)
    return zlib.crc32(name.encode()) % 100_000


def build_gpt(args, tp: int, pp: int = 1, seed: int = 1, ep: int = 1, vp_stage: int | None = None,
              vp: int | None = None):
    """megatron-core's GPTModel (local spec) for ``args`` on this rank (model chunk ``vp_stage`` of ``vp``
    with interleaving), every parameter perturbed so that norms and biases matter: replicated tensors alike
    on every TP rank, sharded ones per rank, each expert by its global number. A model whose
    ``moe_layer_freq`` is a list or above 1 (dense and MoE layers) takes the per-layer block spec of this
    stage (local modules), which Megatron-LM's GPT builder takes for every MoE model; megatron-core then
    keys its layers one by one in torch_dist (non-homogeneous layers)."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    cfg = _config(args, tp, pp, ep, vp)
    torch.manual_seed(seed)
    if isinstance(cfg.moe_layer_freq, list) or cfg.moe_layer_freq > 1:
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization=args.normalization,
                                          pp_rank=ps.get_pipeline_model_parallel_rank())
    else:
        spec = get_gpt_layer_local_spec(num_experts=getattr(args, "num_experts", None),
                                        normalization=args.normalization,
                                        qk_layernorm=getattr(args, "qk_layernorm", False))
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings, parallel_output=False,
                     pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                     post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                     position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
                     rope_scaling=getattr(args, "use_rope_scaling", False),
                     rope_scaling_factor=getattr(args, "rope_scaling_factor", 8.0),
                     vp_stage=vp_stage)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    tied = not args.untie_embeddings_and_output_weights
    offset = get_transformer_layer_offset(cfg, vp_stage, pp_rank)
    experts = (ps.get_expert_model_parallel_rank() * (getattr(args, "num_experts", None) or 0)
               // ps.get_expert_model_parallel_world_size())
    with torch.no_grad():
        for name, p in model.named_parameters():
            sharded = getattr(p, "tensor_model_parallel", False)
            g = torch.Generator().manual_seed(1000 * seed + _global_seed(name, offset, tied, experts)
                                              + (tp_rank + 1 if sharded else 0))
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model.eval()


def logits(model, tokens, hidden_size: int):
    """megatron-core's [b, s, V] logits of ``tokens`` under a causal mask on the last pipeline stage (None
    elsewhere), the hidden states passed stage to stage by hand (no schedule needed for a forward)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    b, s = tokens.shape
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            x = torch.empty(s, b, hidden_size)
            dist.recv(x, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(x)
        out = model(tokens, torch.arange(s).expand(b, s), mask)
        if not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
        return out


def megatron_rng_state(seed: int = 1234) -> dict:
    """The dict Megatron-LM's ``get_rng_state`` (megatron/training/checkpointing.py, not in the pip package,
    so this follows its layout as written there) collects on a rank: Python's, numpy's and torch's states,
    the CUDA generator's and the model-parallel tracker's (``model-parallel-rng``, seeded seed + 2718 + TP
    rank). There is no CUDA here, so those two are states of CUDA's kind made by hand: 16 bytes, the seed
    and the offset as int64, as ``torch.cuda.get_rng_state()`` returns them."""
    import random

    import numpy as np
    import torch
    from megatron.core import parallel_state as ps

    def cuda_kind(s: int):
        return torch.tensor([s, 0], dtype=torch.int64).view(torch.uint8)

    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": cuda_kind(seed),
            "rng_tracker_states": {"model-parallel-rng": cuda_kind(seed + 2718 + ps.get_tensor_model_parallel_rank())}}


def rng_sharded_object(states: list, per_dp: bool = False):
    """``states`` (the rank's list: its one state, or every DP rank's with --data-parallel-random-init) as
    Megatron-LM's ``get_rng_state`` wraps it for torch_dist: ShardedObject ``rng_state`` of global shape
    (PP, TP) at (pp_rank, tp_rank), replica_id the DP x CP rank (only DP rank 0's is written); ``per_dp``
    (Megatron-LM 0.16 with expert parallelism): of shape (PP, TP, DP x CP), every rank's own, replica_id 0."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    at = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank())
    shape = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size())
    dp = ps.get_data_parallel_rank(with_context_parallel=True)
    if per_dp:
        dp_size = ps.get_data_parallel_world_size(with_context_parallel=True)
        return ShardedObject("rng_state", states, (*shape, dp_size), (*at, dp), replica_id=0)
    return ShardedObject("rng_state", states, shape, at, replica_id=dp)


def model_state(model) -> dict:
    """The model's sharded state as Megatron-LM saves it: under ``model``, or ``model0``, ``model1``, ... per
    model chunk (``model`` a list of them, with interleaving)."""
    chunks = model if isinstance(model, list) else [model]
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def save_megatron(model, args, folder: str, iteration: int, optimizer=None, rng=None) -> None:
    """What Megatron-LM's training loop writes for a torch_dist checkpoint (the model's sharded state, of
    each chunk if ``model`` is a list, the args, the iteration; ``optimizer``: the optimizer's sharded state,
    saved as Megatron-LM saves it; ``rng``: its ``rng_state`` ShardedObject, rng_sharded_object) and its
    tracker, written by megatron-core's own dist_checkpointing.save."""
    import os

    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    it_dir = os.path.join(folder, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(it_dir, exist_ok=True)
    dist.barrier()
    state = {**model_state(model), "args": args, "iteration": iteration, "checkpoint_version": 3.0}
    if optimizer is not None:
        state["optimizer"] = optimizer
    if rng is not None:
        state["rng_state"] = rng
    dist_checkpointing.save(state, it_dir)
    _tracker(folder, iteration)



def save_megatron_legacy(model, args, folder: str, iteration: int, optimizer=None, rng=None,
                         distributed=False) -> None:
    """The legacy ``torch`` format as Megatron-LM's training loop writes it: per (TP, PP, EP) rank
    ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` (the PP rank with PP > 1, the EP rank with EP > 1, as its
    ``get_checkpoint_name`` names them) holding the rank's plain state dict (layer and expert numbers local
    to its rank) under 'model' (``model0``, ``model1``, ... if ``model`` is a list of model chunks), the
    args, the iteration, the checkpoint version and the RNG states (``rng``: the rank's list of
    megatron_rng_state dicts; else Python's, numpy's, torch's), written with torch.save by the ranks of DP
    rank 0 or expert DP rank 0 (as Megatron-LM's save_checkpoint picks them); no Megatron-LM code is
    involved. With ``distributed``, ``optimizer`` is megatron-core's distributed optimizer (or its
    ChainedOptimizer): its ``state_dict()`` goes under 'optimizer' and its parameter state to
    ``distrib_optim.pt`` next to the file, by its own ``save_parameter_state`` on every rank (gathered over
    DP, written by DP rank 0), as Megatron-LM's save_checkpoint calls it."""
    import os
    import random

    import numpy as np
    import torch
    from megatron.core import parallel_state as ps

    tp, pp, ep = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                  ps.get_expert_model_parallel_rank())
    rank_dir = f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if ps.get_pipeline_model_parallel_world_size() > 1 else "") + \
        (f"_{ep:03d}" if ps.get_expert_model_parallel_world_size() > 1 else "")
    path = os.path.join(folder, f"iter_{iteration:07d}", rank_dir, "model_optim_rng.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if distributed:
        optimizer.save_parameter_state(os.path.join(os.path.dirname(path), "distrib_optim.pt"))
        optimizer = optimizer.state_dict()
    if rng is None:
        rng = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                "torch_rng_state": torch.get_rng_state()}]
    chunks = model if isinstance(model, list) else [model]
    models = {"model": chunks[0].state_dict()} if len(chunks) == 1 else \
        {f"model{i}": chunk.state_dict() for i, chunk in enumerate(chunks)}
    if ps.get_data_parallel_rank() == 0 or ps.get_expert_data_parallel_rank() == 0:
        torch.save({**models, "args": args, "iteration": iteration, "checkpoint_version": 3.0,
                    "rng_state": rng, **({} if optimizer is None else {"optimizer": optimizer})}, path)
    _tracker(folder, iteration)


def _tracker(folder: str, iteration: int) -> None:
    import os

    import torch.distributed as dist

    if dist.get_rank() == 0:
        with open(os.path.join(folder, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    dist.barrier()
