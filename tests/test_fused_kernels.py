"""Promises of the optional fused kernels (--cross-entropy-loss-fusion, --attention-backend, fused AdamW,
apex), each against the path it replaces, in fp32 on CPU:
- the chunked output layer + vocab-parallel cross-entropy gives the unfused per-token loss and the
  gradients of every parameter at 1e-6, at TP 1 and 2, with sequence parallelism, tied and untied,
  GPT-2 and Llama style, whatever the chunk size (also a rank holding only vocabulary padding);
- through the CLI its loss curve is the unfused one (TP with SP; PP with the embedding tied across stages);
- every --attention-backend choice runs on CPU and gives the unfused attention's loss; 'flash' in fp32 on
  a GPU is refused by name;
- AdamW selection: apex's FusedAdam on a GPU when the real apex is importable, torch's fused AdamW on a
  GPU without it, foreach elsewhere; the unrelated PyPI 'apex' counts as absent; torch's fused AdamW
  computes foreach's numbers; apex's fused norms are called with their own argument order.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from megalite import device
from megalite.config import ConfigError, validate
from megalite.config.arguments import MegaliteConfig, parse_args
from megalite.config.model import ModelConfig
from megalite.model.gpt import GPTModel
from megalite.model.norm import Norm
from megalite.optimizer.adam import build_adamw
from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel import fused_cross_entropy
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.tensor_parallel.fused_cross_entropy import fused_linear_cross_entropy
from megalite.tensor_parallel.init import initialize_parameters
from megalite.tensor_parallel.random import RNGTracker, model_parallel_seed
from tests.cli_utils import launch_pretrain, losses
from tests.harness import run_ranks
from tests.tp_utils import GPT2, LLAMA_GQA, build, groups_for

VOCAB = 1000  # not a multiple of 128 x TP: the last rank holds padding
TOL = dict(rtol=1e-6, atol=1e-6)
DATA = ["--mock-data", "--vocab-size", "100"]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, **TOL)


def _upstream(shape: torch.Size) -> dict[str, torch.Tensor]:
    """Upstream gradients of the per-token loss: a token mean (training's case), a masked mean (some tokens
    weigh 0), arbitrary per-token weights (every token differs)."""
    n = shape.numel()
    mask = (torch.arange(n) % 5 != 2).float()
    return {"mean": torch.full(shape, 1.0 / n), "masked": (mask / mask.sum()).view(shape),
            "weighted": torch.linspace(-1.0, 2.0, n).view(shape) / n}


def _function_pair(x, w, target, pg, vocab, sp: bool, rows: int) -> list[str]:
    """Unfused (gathered input -> GEMM -> CE) against fused, same upstream gradient; differences found."""
    bad = []
    for kind, grad_out in _upstream(target.shape).items():
        bad += [f"{m} ({kind})" for m in _one_pair(x, w, target, pg, vocab, sp, rows, grad_out)]
    return bad


def _one_pair(x, w, target, pg, vocab, sp: bool, rows: int, grad_out: torch.Tensor) -> list[str]:
    results = []
    for fused in (False, True):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        if fused:
            loss = fused_linear_cross_entropy(xi, wi, target, pg, vocab, sp, rows=rows)
        else:
            from megalite.tensor_parallel.layers import linear_gathering_sequence
            from megalite.tensor_parallel.mappings import copy_to_tp

            logits = linear_gathering_sequence(xi, wi, None, pg) if sp else F.linear(copy_to_tp(xi, pg), wi)
            loss = vocab_parallel_cross_entropy(logits, target, pg, vocab)
        (loss * grad_out).sum().backward()
        results.append((loss.detach(), xi.grad, wi.grad))
    return [f"{name} (rows {rows}, sp {sp}): max diff {(a - b).abs().max():.3e}"
            for name, a, b in zip(("loss", "grad x", "grad w"), *results) if not _close(a, b)]


def test_function_matches_unfused_for_any_chunk_size():
    gen = torch.Generator().manual_seed(0)
    s, b, h, vocab = 7, 3, 16, 100
    x, w = torch.randn(s, b, h, generator=gen), torch.randn(128, h, generator=gen) * 0.3
    target = torch.randint(0, vocab, (s, b), generator=gen)
    for rows in (1, 4, 5, 20, 21, 1000):
        assert _function_pair(x, w, target, ProcessGroups.single(), vocab, False, rows) == []


def test_no_grad_evaluation_matches_unfused():
    """Evaluation (no_grad) runs the chunked loss without the gradient products."""
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(9, 2, 16, generator=gen), torch.randn(128, 16, generator=gen) * 0.3
    target = torch.randint(0, 100, (9, 2), generator=gen)
    pg = ProcessGroups.single()
    with torch.no_grad():
        fused = fused_linear_cross_entropy(x.requires_grad_(), w, target, pg, 100, rows=4)
        assert _close(fused, vocab_parallel_cross_entropy(F.linear(x, w), target, pg, 100))


def test_bf16_matches_unfused_within_bf16_rounding():
    """The 16-bit path (GEMMs in bf16, softmax and weight-gradient sums in fp32) against unfused bf16."""
    gen = torch.Generator().manual_seed(2)
    s, b, h, vocab = 16, 2, 32, 200
    x, w = torch.randn(s, b, h, generator=gen).bfloat16(), (torch.randn(256, h, generator=gen) * 0.2).bfloat16()
    target = torch.randint(0, vocab, (s, b), generator=gen)
    pg, out = ProcessGroups.single(), []
    for fused in (False, True):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = (fused_linear_cross_entropy(xi, wi, target, pg, vocab, rows=5) if fused
                else vocab_parallel_cross_entropy(F.linear(xi, wi), target, pg, vocab))
        (loss * 1e3).mean().backward()
        assert xi.grad.dtype == wi.grad.dtype == torch.bfloat16
        out.append((loss.float(), xi.grad.float(), wi.grad.float()))
    for a, b_ in zip(*out):
        assert torch.allclose(a, b_, rtol=2e-2, atol=2e-2 * b_.abs().max().item())


def _ranks_function(rank: int, world: int) -> list[str]:
    """TP 2, with and without SP, vocab 100 padded to 256: rank 1's 128 columns are all padding."""
    pg = groups_for(world, rank, tp=2)
    gen = torch.Generator().manual_seed(3)
    s, b, h, vocab = 8, 3, 16, 100
    x_full, target = torch.randn(s, b, h, generator=gen), torch.randint(0, vocab, (s, b), generator=gen)
    w = (torch.randn(256, h, generator=gen) * 0.3).chunk(2)[rank].contiguous()
    bad = []
    for rows in (2, 5, 100):
        bad += _function_pair(x_full, w, target, pg, vocab, False, rows)
        bad += _function_pair(x_full.chunk(2)[rank].contiguous(), w, target, pg, vocab, True, rows)
    return bad


def test_function_matches_unfused_at_tp2_with_a_padding_only_rank():
    assert run_ranks(_ranks_function, 2) == [[], []]


def _model_outputs(kw: dict, pg, sp: bool, fused: bool) -> tuple[torch.Tensor, dict]:
    cfg = ModelConfig(**kw, cross_entropy_loss_fusion=fused)
    ctx = BuildContext(pg, model_parallel_seed(1234, pg.tp_rank, pg.pp_rank), sequence_parallel=sp)
    model = GPTModel(cfg, ctx, VOCAB)
    initialize_parameters(model, pg, 1234, cfg.init_method_std, cfg.num_layers)
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (3, cfg.seq_length + 1), generator=gen)
    grads = {}
    for kind, grad_out in _upstream(tokens[:, 1:].shape).items():  # both backwards consume their graph
        model.zero_grad()
        loss = model(tokens[:, :-1], labels=tokens[:, 1:])
        (loss * grad_out).sum().backward()
        grads.update({f"{n} ({kind})": p.grad.clone() for n, p in model.named_parameters()})
    return loss.detach(), grads


def _ranks_model(rank: int, world: int) -> dict:
    # several chunks of 7 tokens, the last one short
    fused_cross_entropy.CHUNK_ELEMENTS, fused_cross_entropy.MIN_CHUNK_TOKENS = 7 * 512, 1
    report = {}
    for case, kw in {"gpt2_tied": GPT2, "llama_untied": LLAMA_GQA}.items():
        for layout, tp, sp in (("tp1", 1, False), ("tp2", 2, False), ("tp2_sp", 2, True)):
            pg = groups_for(1, 0) if tp == 1 else groups_for(world, rank, tp=tp)
            (l0, g0), (l1, g1) = (_model_outputs(kw, pg, sp, f) for f in (False, True))
            bad = [] if _close(l0, l1) else [f"loss {(l0 - l1).abs().max():.3e}"]
            bad += [f"grad {n}: {(g0[n] - g1[n]).abs().max():.3e}" for n in g0 if not _close(g0[n], g1[n])]
            report[(case, layout)] = bad
    return report


@pytest.fixture(scope="module")
def model_reports() -> list[dict]:
    return run_ranks(_ranks_model, 2)


@pytest.mark.parametrize("case", ["gpt2_tied", "llama_untied"])
@pytest.mark.parametrize("layout", ["tp1", "tp2", "tp2_sp"])
def test_model_loss_and_grads_match_unfused(model_reports, case, layout):
    for rank, report in enumerate(model_reports):
        assert report[(case, layout)] == [], f"rank {rank}: {report[(case, layout)]}"


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                                    ["--pipeline-model-parallel-size", "2"]], ids=["tp2_sp", "pp2_tied"])
def test_cli_loss_curve_matches_unfused(layout):
    args = ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "6", "--lr", "1e-3",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--log-interval", "1", "--eval-iters", "0", "--num-layers", "2",
            "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", *layout]
    plain = losses(launch_pretrain(args, nproc=2))
    fused = losses(launch_pretrain(args + ["--cross-entropy-loss-fusion"], nproc=2))
    assert sorted(fused) == sorted(plain) == list(range(1, 7))
    for it, (loss, norm) in plain.items():
        assert abs(fused[it][0] - loss) <= 1e-6 * loss, f"iteration {it}: {fused[it]} vs {loss}"
        assert abs(fused[it][1] - norm) <= 1e-5 * norm, f"iteration {it} grad norm: {fused[it]} vs {norm}"


@pytest.mark.parametrize("kw", [GPT2, LLAMA_GQA], ids=["gpt2", "llama_gqa"])
def test_every_attention_backend_gives_the_unfused_loss_on_cpu(kw):
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (2, kw["seq_length"] + 1), generator=gen)
    pg = ProcessGroups.single()
    ref = None
    for backend in ("unfused", "local", "auto", "flash", "fused", "sdpa"):
        loss = build(ModelConfig(**kw, attention_backend=backend), pg, VOCAB)(tokens[:, :-1], labels=tokens[:, 1:])
        ref = loss if ref is None else ref
        assert torch.allclose(loss, ref, rtol=1e-5, atol=1e-6), f"{backend}: {(loss - ref).abs().max():.3e}"


def test_attention_backend_flags_and_the_flash_fp32_rule(monkeypatch):
    for choice in ("flash", "fused", "unfused", "local", "auto"):
        assert parse_args(["--attention-backend", choice, *DATA]).model.attention_backend == choice
    cfg = parse_args(["--attention-backend", "flash", *DATA])
    validate(cfg, 1)  # CPU: SDPA's CPU kernel runs fp32
    for choice in ("flash", "fused"):
        assert type(device.sdpa_kernels(choice, torch.device("cpu"))).__name__ == "nullcontext"
        assert type(device.sdpa_kernels(choice, torch.device("cuda"))).__name__ != "nullcontext"
    monkeypatch.setattr(device, "has_cuda", lambda: True)
    with pytest.raises(ConfigError, match="--attention-backend flash needs --bf16 or --fp16"):
        validate(parse_args(["--attention-backend", "flash", *DATA]), 1)
    validate(parse_args(["--attention-backend", "flash", "--bf16", *DATA]), 1)
    validate(parse_args(["--attention-backend", "fused", *DATA]), 1)


def test_cross_entropy_loss_fusion_flag():
    assert parse_args(DATA).model.cross_entropy_loss_fusion is False
    assert parse_args(["--cross-entropy-loss-fusion", *DATA]).model.cross_entropy_loss_fusion is True
    assert MegaliteConfig.from_flat({"cross_entropy_loss_fusion": True}).model.cross_entropy_loss_fusion


# --- AdamW and apex selection -------------------------------------------------------------------------

def _install(monkeypatch, modules: dict[str, types.ModuleType | None]) -> None:
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    device.clear_apex_cache()


@pytest.fixture(autouse=True)
def _fresh_apex_lookup():
    device.clear_apex_cache()
    yield
    device.clear_apex_cache()


def _params() -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    ps = [torch.nn.Parameter(torch.randn(5, 3, generator=gen)), torch.nn.Parameter(torch.randn(3, generator=gen))]
    return [{"params": [ps[0]], "weight_decay": 0.1}, {"params": [ps[1]], "weight_decay": 0.0}]


def _run(opt: torch.optim.Optimizer, steps: int = 5) -> list[torch.Tensor]:
    params = [p for g in opt.param_groups for p in g["params"]]
    for i in range(steps):
        for j, p in enumerate(params):
            p.grad = torch.sin(torch.arange(p.numel(), dtype=torch.float32) * (i + 1) + j).view(p.shape)
        opt.step()
    return [p.detach().clone() for p in params]


def test_torch_fused_adamw_computes_the_foreach_numbers(monkeypatch):
    _install(monkeypatch, {"apex": None})  # no apex at all: import fails
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    fused, foreach = build_adamw(_params(), on_gpu=True, **kw), build_adamw(_params(), on_gpu=False, **kw)
    assert fused.defaults["fused"] and foreach.defaults["foreach"] and not foreach.defaults["fused"]
    for a, b in zip(_run(fused), _run(foreach)):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def test_unrelated_pypi_apex_counts_as_absent(monkeypatch):
    _install(monkeypatch, {"apex": types.ModuleType("apex")})  # a plain module: no apex.optimizers inside
    assert device.apex_fused_adam_class() is None
    assert device.apex_fused_norm("LayerNorm", "cuda") is None
    assert isinstance(build_adamw(_params(), on_gpu=True, lr=1e-3, betas=(0.9, 0.99), eps=1e-8),
                      torch.optim.AdamW)


class _FakeFusedAdam(torch.optim.AdamW):
    """apex's FusedAdam conventions: adam_w_mode, the step counted per group."""

    def __init__(self, params, adam_w_mode: bool, **kw):
        assert adam_w_mode
        super().__init__(params, foreach=True, **kw)

    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
        return super().step(closure)


def _fake_apex() -> dict[str, types.ModuleType]:
    apex, opt, norm, fln, amp_c, ln_cuda = (types.ModuleType(n) for n in (
        "apex", "apex.optimizers", "apex.normalization", "apex.normalization.fused_layer_norm", "amp_C",
        "fused_layer_norm_cuda"))
    apex.__path__, norm.__path__ = [], []
    opt.FusedAdam = _FakeFusedAdam
    fln.fused_layer_norm_affine = lambda x, w, b, shape, eps: F.layer_norm(x, shape, w, b, eps) + 0
    fln.fused_rms_norm_affine = lambda x, w, shape, eps: F.rms_norm(x, shape, w, eps) + 0
    return {"apex": apex, "apex.optimizers": opt, "apex.normalization": norm,
            "apex.normalization.fused_layer_norm": fln, "amp_C": amp_c, "fused_layer_norm_cuda": ln_cuda}


def test_real_apex_is_used_on_gpu_only(monkeypatch):
    _install(monkeypatch, _fake_apex())
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    on_gpu = build_adamw(_params(), on_gpu=True, **kw)
    assert isinstance(on_gpu, _FakeFusedAdam)
    assert not isinstance(build_adamw(_params(), on_gpu=False, **kw), _FakeFusedAdam)
    _run(on_gpu, 3)  # the per-parameter step (what checkpoints save) follows apex's group count
    assert all(float(on_gpu.state[p]["step"]) == 3 for g in on_gpu.param_groups for p in g["params"])
    for g in on_gpu.param_groups:  # a restored checkpoint's step reaches the group count
        for p in g["params"]:
            on_gpu.state[p]["step"] = torch.tensor(10.0)
    _run(on_gpu, 1)
    assert all(g["step"] == 11 for g in on_gpu.param_groups)
    assert device.apex_fused_norm("LayerNorm", "cpu") is None
    assert device.apex_fused_norm("RMSNorm", "cuda") is sys.modules[
        "apex.normalization.fused_layer_norm"].fused_rms_norm_affine


def test_apex_without_its_cuda_extensions_counts_as_absent(monkeypatch):
    _install(monkeypatch, {**_fake_apex(), "amp_C": None, "fused_layer_norm_cuda": None})
    assert device.apex_fused_adam_class() is None
    assert device.apex_fused_norm("LayerNorm", "cuda") is None
    assert not isinstance(build_adamw(_params(), on_gpu=True, lr=1e-3, betas=(0.9, 0.99), eps=1e-8),
                          _FakeFusedAdam)


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_norm_calls_apex_with_its_argument_order(monkeypatch, kind):
    fln = _fake_apex()["apex.normalization.fused_layer_norm"]
    calls = []

    def fake(k, device_type):
        fn = fln.fused_layer_norm_affine if k == "LayerNorm" else fln.fused_rms_norm_affine
        return lambda *a: calls.append(k) or fn(*a)

    norm = Norm(ModelConfig(hidden_size=8, normalization=kind, norm_epsilon=1e-5),
                BuildContext(ProcessGroups.single(), RNGTracker()))
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 2, 8)
    expected = norm(x)
    monkeypatch.setattr(device, "apex_fused_norm", fake)
    assert torch.equal(norm(x), expected) and calls == [kind]
