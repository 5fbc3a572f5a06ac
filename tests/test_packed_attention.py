"""Promise (docs/parallelism.md, "Packed documents"): attention inside packed documents equals running every
document as its own sequence, on every backend, in fp32 at 1e-5 — the attention core, and the whole model
(positions restarted per document) with and without recomputation — and no path builds a mask: no tensor
of s x s elements (nor s_local x s under context parallelism) exists while it runs.

The layouts (TP/SP, PP, CP of every comm type, DP) against the serial run are in
tests/test_packed_training.py; the CP attention core on real ranks is in
tests/test_context_parallel_attention.py.
"""

from __future__ import annotations

import pytest
import torch

from megalite.attention import Chunk, Documents, Piece, blocks, chunk_pieces, core_attention
from megalite.config.model import ModelConfig
from megalite.context_parallel import context_parallel_attention
from megalite.parallel.groups import ProcessGroups
from tests.asserts import LargestResult
from tests.tp_utils import GPT2, LLAMA_GQA, build

VOCAB = 64
LENGTHS = [[7, 16, 1, 8], [32]]  # per sample; a one-token document included


def packed(lengths: list[list[int]] = LENGTHS) -> Documents:
    flat = torch.tensor([n for row in lengths for n in row])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), flat.cumsum(0)])
    return Documents.from_cu_seqlens(cu, len(lengths), sum(lengths[0]))


# ---- the boundaries and the pieces -------------------------------------------------------------------
def test_boundaries_from_cumulative_lengths():
    docs = packed()
    assert docs.bounds == ((0, 7, 23, 24, 32), (0, 32)) and docs.seq_length == 32 and not docs.uniform
    assert docs.lengths(0) == [7, 16, 1, 8]
    assert docs.work() == 28 + 136 + 1 + 36 + 528


@pytest.mark.parametrize("cu,why", [([0, 5, 64], "sample's start"), ([1, 32, 64], "from 0"),
                                    ([0, 32, 32, 64], "strictly"), ([0, 32, 60], "to batch x seq")])
def test_bad_boundaries_are_named(cu, why):
    with pytest.raises(ValueError, match=why):
        Documents.from_cu_seqlens(torch.tensor(cu), 2, 32)


def test_pieces_cut_blocks_at_documents():
    docs = packed([[5, 11]])
    # the diagonal block 0:8 holds a 5-token triangle and a 3-token one
    assert docs.pieces(0, 8, 0, 8) == [Piece(slice(0, 1), 0, 5, 0, 5, True), Piece(slice(0, 1), 5, 8, 5, 8, True)]
    # queries 8:16 against earlier keys 0:8: only the second document's 5:8 columns
    assert docs.pieces(8, 16, 0, 8) == [Piece(slice(0, 1), 8, 16, 5, 8, False)]
    assert docs.pieces(0, 8, 8, 16) == []  # keys after the queries
    with pytest.raises(ValueError, match="overlap"):
        docs.pieces(0, 8, 4, 12)
    whole = Documents.whole(3, 16)
    assert whole.pieces(0, 16, 0, 16) == [Piece(slice(None), 0, 16, 0, 16, True)]  # the batch at once
    local = chunk_pieces(docs, [Chunk(8, 8, 0)], [Chunk(0, 8, 8)])
    assert local == [Piece(slice(0, 1), 0, 8, 13, 16, False)]


# ---- the attention core ------------------------------------------------------------------------------
def per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents) -> torch.Tensor:
    """Each document as its own sequence through the unfused reference, outputs put back in place."""
    out = torch.zeros_like(q)
    for b, e in enumerate(docs.bounds):
        for lo, hi in zip(e, e[1:]):
            out[b:b + 1, :, lo:hi] = core_attention(q[b:b + 1, :, lo:hi], k[b:b + 1, :, lo:hi],
                                                    v[b:b + 1, :, lo:hi], 0.0, "unfused")
    return out


def qkv(nq: int = 8, nkv: int = 2, b: int = 2, s: int = 32, d: int = 8, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, s, d, generator=g) for n in (nq, nkv, nkv, nq)]


def grads(fn, q, k, v, dout) -> list[torch.Tensor]:
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("backend", ["unfused", "auto", "flash", "fused", "local"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_core_attention_equals_each_document_alone(backend, heads):
    q, k, v, dout = qkv(*heads)
    docs = packed()
    got = grads(lambda a, b, c: core_attention(a, b, c, 0.0, backend, docs), q, k, v, dout)
    want = grads(lambda a, b, c: per_document(a, b, c, docs), q, k, v, dout)
    for name, a, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("comm", ["p2p", "a2a", "allgather", "a2a+p2p"])
@pytest.mark.parametrize("fused", [True, False], ids=["cpu_flash_kernel", "plain"])
def test_blockwise_paths_equal_each_document_alone(comm, fused, monkeypatch):
    monkeypatch.setattr(blocks, "FUSED", fused)
    monkeypatch.setattr(blocks, "ROW_TILE", 5)
    q, k, v, dout = qkv()
    docs = packed()
    got = grads(lambda a, b, c: context_parallel_attention(a, b, c, ProcessGroups.single(), comm, documents=docs),
                q, k, v, dout)
    want = grads(lambda a, b, c: per_document(a, b, c, docs), q, k, v, dout)
    for name, a, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("path", ["core", "p2p", "a2a", "allgather", "a2a+p2p"])
def test_no_path_builds_a_mask(path):
    """8 documents in 512 positions, one head of 4 channels: q, k, v hold 2048 elements; an s x s mask 262,144.
    Every operation's result stays below s^2 / 8 (the largest document's own scores: 64 x 64 = 4096)."""
    s = 512
    q, k, v, dout = qkv(1, 1, b=1, s=s, d=4)
    docs = packed([[64] * 8])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with LargestResult() as seen:
        if path == "core":
            out = core_attention(*leaves, 0.0, "unfused", docs)
        else:
            out = context_parallel_attention(*leaves, ProcessGroups.single(), path, documents=docs)
        out.backward(dout)
    assert seen.numel <= s * s // 8, f"{path}: an operation returned {seen.numel} elements"


# ---- the whole model ---------------------------------------------------------------------------------
def _tokens(lengths: list[list[int]], seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (len(lengths), sum(lengths[0]) + 1), generator=g)


def _reset_positions(docs: Documents) -> torch.Tensor:
    rows = [torch.cat([torch.arange(n) for n in docs.lengths(b)]) for b in range(docs.batch)]
    return torch.stack(rows)


MODEL_CASES = {"gpt2": ({**GPT2, "seq_length": 32}, {}),
               "llama": ({**LLAMA_GQA, "seq_length": 32}, {}),
               "llama_recompute_full": ({**LLAMA_GQA, "seq_length": 32},
                                        {"recompute_granularity": "full", "recompute_method": "uniform",
                                         "recompute_num_layers": 1}),
               "gpt2_recompute_selective": ({**GPT2, "seq_length": 32}, {"recompute_granularity": "selective"}),
               "llama_unfused": ({**LLAMA_GQA, "seq_length": 32}, {"attention_backend": "unfused"})}


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_model_equals_each_document_alone(case):
    """Per-token losses and gradients of a packed batch (positions reset, attention per document) equal those
    of every document run as its own sequence from position 0 (fp32, 1e-5)."""
    shape, extra = MODEL_CASES[case]
    model = build(ModelConfig(**shape, **extra), ProcessGroups.single(), VOCAB)
    model.train()
    text = _tokens(LENGTHS)
    tokens, labels = text[:, :-1], text[:, 1:]
    docs = packed()
    packed_loss = model(tokens, labels=labels, position_ids=_reset_positions(docs), documents=docs)
    packed_loss.sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    alone = torch.zeros_like(packed_loss)
    for b, e in enumerate(docs.bounds):
        for lo, hi in zip(e, e[1:]):
            loss = model(tokens[b:b + 1, lo:hi], labels=labels[b:b + 1, lo:hi])
            alone[b, lo:hi] = loss.detach()[0]
            loss.sum().backward()
    torch.testing.assert_close(packed_loss.detach(), alone, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[n], p.grad, rtol=1e-5, atol=1e-5, msg=n)
