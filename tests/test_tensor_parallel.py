"""Promise: TP in {2, 4} gives the TP=1 logits, loss and every (gathered) gradient, for GPT-2 and
Llama configs, with a vocab that is not a multiple of 128 x TP, and with GQA groups < TP."""

from __future__ import annotations

import pytest
import torch

from megalite.config.model import ModelConfig
from megalite.distributed.finalize import finalize_grads
from megalite.distributed.grad_buffer import GradBuffer
from megalite.model.gpt import TIED_EMBEDDING, GPTModel
from megalite.optimizer.clip import global_grad_norm
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.param_meta import param_meta
from megalite.tensor_parallel.random import RNGTracker
from megalite.tensor_parallel.sharding import VocabShardSpec
from tests.harness import run_ranks
from tests.tp_utils import GPT2, LLAMA_GQA, build, gather_full, groups_for

VOCAB = 1000  # not a multiple of 128 x TP
CASES = {"gpt2": GPT2, "llama_gqa_groups_lt_tp": LLAMA_GQA,
         "llama_mha": {**LLAMA_GQA, "group_query_attention": False, "num_attention_heads": 4},
         # q/k norms per head (partial weight gradients over TP), and over the projection with norms after the
         # sublayers (the sums of squares all-reduced; the k norm copied when TP 4 exceeds the 2 groups)
         "qk_head": {**LLAMA_GQA, "qk_layernorm": True},
         "qk_projection_post_norms": {**LLAMA_GQA, "qk_layernorm": True, "qk_layernorm_scope": "projection",
                                      "sublayer_norms": "post"}}


def _outputs(kw: dict, pg) -> dict:
    cfg = ModelConfig(**kw)
    model = build(cfg, pg, VOCAB)
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (3, cfg.seq_length + 1), generator=gen)
    logits = model(tokens[:, :-1])
    buffers = [GradBuffer(list(model.parameters()), pg, grad_dtype=torch.float32, bucket_size=5000)]
    loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    loss.backward()
    finalize_grads([model], buffers, pg)
    params = list(model.parameters())
    return {
        "logits": logits.detach(),
        "loss": loss.detach(),
        "grad_norm": global_grad_norm(params, pg),
        "params": {n: gather_full(p, p.detach(), pg) for n, p in model.named_parameters()},
        "grads": {n: gather_full(p, p.main_grad, pg) for n, p in model.named_parameters()},
    }


def _compare(ref: dict, out: dict) -> list[str]:
    bad = []
    for key in ("logits", "loss"):
        if not torch.allclose(ref[key], out[key], rtol=1e-5, atol=1e-5):
            bad.append(f"{key}: max diff {(ref[key] - out[key]).abs().max():.3e}")
    if abs(ref["grad_norm"] - out["grad_norm"]) > 1e-5 * ref["grad_norm"]:
        bad.append(f"grad norm {out['grad_norm']} != {ref['grad_norm']}")
    for kind in ("params", "grads"):
        if ref[kind].keys() != out[kind].keys():
            bad.append(f"{kind} names differ: {sorted(ref[kind].keys() ^ out[kind].keys())}")
            continue
        for name, r in ref[kind].items():
            o = out[kind][name]
            if r.shape != o.shape or not torch.allclose(r, o, rtol=1e-4, atol=1e-6):
                diff = (r - o).abs().max() if r.shape == o.shape else f"shape {tuple(o.shape)} vs {tuple(r.shape)}"
                bad.append(f"{kind} {name}: {diff}")
    return bad


def _check_all_layouts(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    report = {}
    for case, kw in CASES.items():
        ref = _outputs(kw, groups_for(1, 0))
        for tp in (2, 4):
            report[(case, tp)] = _compare(ref, _outputs(kw, groups_for(world, rank, tp=tp)))
    return report


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return run_ranks(_check_all_layouts, 4)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_serial_logits_loss_and_grads(reports, case, tp):
    for rank, report in enumerate(reports):
        assert report[(case, tp)] == [], f"rank {rank}: {report[(case, tp)]}"


def test_param_meta_declared_once_with_defaults():
    """Every parameter's metadata is read through param_meta(); the model amends the tie and the fused QKV."""
    cfg = ModelConfig(**{**GPT2, "untie_embeddings_and_output_weights": False})
    last = GPTModel(cfg, BuildContext(groups_for(1, 0), RNGTracker(), device=torch.device("meta")), VOCAB,
                    pre_process=False)
    out = param_meta(last.output_layer.weight)
    assert (out.copy_of, out.tied_embedding, out.full_shape) == (TIED_EMBEDDING, True, (VOCAB, cfg.hidden_size))
    assert isinstance(out.spec, VocabShardSpec)
    qkv = param_meta(last.layers["0"].attention.qkv.weight)
    assert qkv.full_shape == (3 * cfg.hidden_size, cfg.hidden_size) and qkv.copy_of is None and qkv.init == "normal"
    bare = param_meta(torch.nn.Parameter(torch.zeros(3, 2)))
    assert (bare.full_shape, bare.spec.replicated, bare.init, bare.tied_embedding) == ((3, 2), True, "normal", False)
