"""Promise (--attn-logit-softcapping C, attention/blocks.py and core.py): every attention path turns each scaled
score s into C·tanh(s/C) before the masks and the softmax, forward and backward, and none drops it.

- the one-rank core on every --attention-backend (the SDPA ones run blockwise, 'unfused'/'local' the explicit
  softmax), with and without a window and packed documents, tiles small enough that every kind of piece
  occurs: output and dQ/dK/dV equal the written-out softmax(C·tanh(s/C)) at 1e-5;
- the blockwise merge context parallelism runs (each CP rank's zigzag rows against every holder's keys, the
  log-sum-exp merge, and the backward through tanh), in one process, with a window and documents;
- KV-cache decoding (queries after the cached keys) on the SDPA and unfused backends, with a window;
- a model with Gemma 2's pattern (alternating window, capped) trains with the serial curve at CP 2 (p2p, a2a,
  allgather, a2a+p2p over 1 x 2) and TP2 + SP with selective recomputation, under NCCL's point-to-point rules;
  the cap changes the curve;
- the planner's FLOPs (3 per score) and unfused activation bytes (the kept tanh, as autograd saves it), the
  flag's domain, older checkpoints loading, and to-megatron's refusal by name.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from megalite.attention import Documents, blocks, chunk_pieces, core_attention
from megalite.attention import window as win
from megalite.context_parallel import zigzag_split
from megalite.context_parallel.zigzag import zigzag_chunks
from tests.layouts import LayoutMatrix, serial_curve
from tests.tp_utils import LLAMA_GQA, layout_flat

CAP = 1.0  # scores of unit-normal q, k are O(1): the cap bends them well away from the identity
LENGTHS = [[7, 9, 1, 7], [3, 21]]  # per sample: a one-token document, boundaries inside tiles and chunks
BACKENDS = ("auto", "flash", "fused", "unfused", "local", "sdpa")


def packed() -> Documents:
    cu = [0, *itertools.accumulate(n for row in LENGTHS for n in row)]
    return Documents.from_cu_seqlens(torch.tensor(cu), len(LENGTHS), sum(LENGTHS[0]))


def allowed_mask(s: int, docs: Documents | None, window: int, b: int = 2) -> torch.Tensor:
    """[b, s, s] bool: causal, inside the window (0: none) and the sample's document."""
    i, j = torch.arange(s)[:, None], torch.arange(s)[None]
    allowed = ((j <= i) & ((j > i - window) if window else True)).expand(b, s, s).clone()
    for bi, e in enumerate(docs.bounds if docs is not None else []):
        doc = torch.zeros(s, dtype=torch.long)
        for n, (a, c) in enumerate(zip(e, e[1:])):
            doc[a:c] = n
        allowed[bi] &= doc[:, None] == doc[None]
    return allowed


def reference(q, k, v, allowed: torch.Tensor, cap: float = CAP) -> torch.Tensor:
    """Written out: softmax(C·tanh((q·k/√d)/C) masked) v, K/V repeated to the query heads."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = cap * torch.tanh(scores / cap)
    return scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1) @ v


def _inputs(s: int = 24, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, n, s, 8, generator=g) for n in (4, 2, 2, 4)]  # q, k, v (GQA), dout


def _close(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for name, a, w in zip(("out", "dq", "dk", "dv"), got, want):
        err = float((a - w).abs().max())
        assert err <= 1e-5 * max(1.0, float(w.abs().max())), f"{what} {name}: {err:.2e}"


@pytest.mark.parametrize("window,docs", [(0, False), (0, True), (5, False), (5, True)])
def test_core_caps_on_every_backend(monkeypatch, window, docs):
    monkeypatch.setattr(win, "TILE", 3)  # causal, full, flipped and band-masked pieces all occur
    monkeypatch.setattr(blocks, "ROW_TILE", 5)  # and the plain path's score tiles split the rows
    q, k, v, dout = _inputs()
    d = packed() if docs else None
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = reference(*full, allowed_mask(24, d, window))
    want.backward(dout)
    uncapped = core_attention(q, k, v, 0.0, "unfused", d, window)
    assert (uncapped - want).abs().max() > 1e-2, "the cap must matter in this test"
    for backend in BACKENDS:
        mine = [t.clone().requires_grad_() for t in (q, k, v)]
        got = core_attention(*mine, 0.0, backend, d, window, CAP)
        got.backward(dout)
        _close([got.detach(), *[t.grad for t in mine]], [want.detach(), *[t.grad for t in full]], backend)


@pytest.mark.parametrize("window,docs", [(0, True), (5, False), (5, True)])
def test_cp_blockwise_merge_caps(monkeypatch, window, docs):
    """What p2p, allgather and a2a+p2p compute on each of c = 2 ranks, without the messages: the rank's zigzag
    rows against every holder's keys (the own block first), merged by log-sum-exp; dK/dV summed per owner."""
    monkeypatch.setattr(win, "TILE", 3)
    c, s = 2, 24
    q, k, v, dout = _inputs(s, seed=1)
    d = packed() if docs else Documents.whole(2, s)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = reference(*full, allowed_mask(s, packed() if docs else None, window))
    want.backward(dout)
    d = d.with_window(window)
    s_local = s // c
    kv = [torch.stack([zigzag_split(k, 2, c, j), zigzag_split(v, 2, c, j)]) for j in range(c)]
    dkv = [torch.zeros(kv[0].shape) for _ in range(c)]
    for r in range(c):
        ql, dl = zigzag_split(q, 2, c, r), zigzag_split(dout, 2, c, r)
        out = torch.zeros(ql.shape)
        lse = torch.full(ql.shape[:3], float("-inf"))
        order = [(r - t) % c for t in range(c)]
        pieces = {j: chunk_pieces(d, zigzag_chunks(r, c, s_local), zigzag_chunks(j, c, s_local)) for j in order}
        for j in order:
            blocks.attend(ql, kv[j], pieces[j], out, lse, 0.0, CAP)
        delta = (dl * out).sum(-1)
        dq = torch.zeros(ql.shape)
        for j in order:
            dkv[j] += blocks.attend_backward(ql, kv[j], pieces[j], out, lse, dl, delta, dq, 0.0, CAP)
        _close([out, dq], [zigzag_split(want.detach(), 2, c, r), zigzag_split(full[0].grad, 2, c, r)], f"rank {r}")
    for j in range(c):
        _close([dkv[j][0], dkv[j][1]], [zigzag_split(full[1].grad, 2, c, j), zigzag_split(full[2].grad, 2, c, j)],
               f"owner {j} dk, dv")


@pytest.mark.parametrize("window", [0, 5])
def test_decoding_caps(window):
    """Queries after cached keys (the generation step's shape) on the SDPA and unfused backends."""
    q, k, v, _ = _inputs()
    want = reference(q, k, v, allowed_mask(24, None, window))[:, :, -3:]
    for backend in ("auto", "unfused"):
        got = core_attention(q[:, :, -3:], k, v, 0.0, backend, None, window, CAP)
        assert (got - want).abs().max() <= 1e-5, backend


# ---- the model, at every layout ----------------------------------------------------------------------
VOCAB, ITERS = 256, 4
GEMMA2 = {"window_size": [5, 0], "window_attn_skip_freq": "2", "attn_logit_softcapping": 1.0}
# init std 0.2: scores of order 1, which the cap bends (at 0.02 they are ~0.05 and the cap changes the loss
# by 1e-5 only, too little to tell a dropped cap from rounding)
MODELS = {"gemma2_capped": {**LLAMA_GQA, "seq_length": 32, "init_method_std": 0.2, **GEMMA2}}
LAYOUTS = {
    "cp2_p2p": (1, 1, 2, {}),
    "cp2_a2a": (1, 1, 2, {"cp_comm_type": "a2a"}),
    "cp2_allgather": (1, 1, 2, {"cp_comm_type": "allgather"}),
    "cp2_a2a_p2p": (1, 1, 2, {"cp_comm_type": "a2a+p2p", "hierarchical_context_parallel_sizes": [1, 2]}),
    "tp2_sp_selective": (2, 1, 1, {"sequence_parallel": True, "recompute_granularity": "selective"}),
}


def flat(model: str, tp: int = 1, pp: int = 1, cp: int = 1, **extra) -> dict:
    return layout_flat(MODELS[model], vocab=VOCAB, iters=ITERS, tp=tp, pp=pp, context_parallel_size=cp, **extra)


MATRIX = LayoutMatrix(2, flat, LAYOUTS, [(m, n) for m in MODELS for n in LAYOUTS], [])


@pytest.mark.parametrize("mode,model,layout", MATRIX.params())
def test_capped_model_gives_the_serial_curve(mode, model, layout):
    MATRIX.check(mode, model, layout, ITERS)


def test_the_cap_changes_the_curve():
    capped = serial_curve(flat("gemma2_capped"))
    plain = serial_curve({k: v for k, v in flat("gemma2_capped").items() if k != "attn_logit_softcapping"})
    assert max(abs(a - b) / b for a, b in zip(capped.losses, plain.losses)) > 1e-3  # 100x the layouts' rtol


# ---- planner, flag, checkpoints ----------------------------------------------------------------------
def test_planner_counts_the_cap():
    from megalite.config.arguments import MegaliteConfig
    from megalite.config.model import ModelConfig
    from megalite.model.activation_memory import saved_bytes
    from megalite.planning.flops import flops_per_token
    from megalite.planning.memory import core_attention_bytes
    from megalite.planning.shape import RunShape

    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, window_size=[127, 0], window_attn_skip_freq="2")
    s = 1024
    plain, capped = ModelConfig(**base), ModelConfig(**base, attn_logit_softcapping=30.0)
    assert flops_per_token(capped, 1000, s) - flops_per_token(plain, 1000, s) == 2 * 3 * 4 * (128 + s)

    b, a, s = 2, 4, 16
    flat = dict(num_layers=1, hidden_size=32, num_attention_heads=a, seq_length=s, attention_backend="unfused",
                micro_batch_size=b, global_batch_size=b, bf16=True)
    shapes = [RunShape.of(MegaliteConfig.from_flat({**flat, **cap}), 1, 256)
              for cap in ({}, {"attn_logit_softcapping": 30.0})]
    qkv = [torch.randn(b, a, s, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    measured = (saved_bytes(core_attention, *qkv, 0.0, "unfused", None, 0, 30.0)
                - saved_bytes(core_attention, *qkv, 0.0, "unfused"))
    assert core_attention_bytes(shapes[1]) - core_attention_bytes(shapes[0]) == measured == 2 * b * a * s * s
    # the blockwise path a capped layer runs on SDPA's backends keeps what SDPA keeps (no s x s term)
    assert saved_bytes(core_attention, *qkv, 0.0, "auto", None, 0, 30.0) == saved_bytes(core_attention, *qkv, 0.0,
                                                                                        "auto")


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_flag_domain_is_named(value):
    from megalite.config import validate
    from megalite.config.arguments import parse_args
    from megalite.config.validate import ConfigError

    with pytest.raises(ConfigError, match=r"--attn-logit-softcapping must be a finite number > 0"):
        validate(parse_args(["--attn-logit-softcapping", value]), 1)


def test_checkpoints_and_megatron_export():
    from megalite.checkpointing.errors import CheckpointError
    from megalite.checkpointing.load import shape_diffs
    from megalite.checkpointing.megatron.export import _refuse_unexported

    older = {"num_layers": 2}  # written before the flag existed: no cap
    assert shape_diffs(older, {"num_layers": 2, "attn_logit_softcapping": None}) == []
    assert shape_diffs(older, {"num_layers": 2, "attn_logit_softcapping": 50.0}) == [
        "--attn-logit-softcapping: checkpoint None, flags 50.0"]
    with pytest.raises(CheckpointError, match="to-megatron: --attn-logit-softcapping 50 is not exported"):
        _refuse_unexported({"attn_logit_softcapping": 50.0})
