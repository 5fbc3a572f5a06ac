"""Promise: context-parallel attention equals full-sequence causal attention (docs/parallelism.md,
"Context parallelism").

On real gloo ranks, CP 2 and 4, comm types p2p (ring), a2a, allgather and a2a+p2p (2 x c/2), MHA and GQA,
with and without documents whose boundaries cross the zigzag chunks: every rank's output rows and dQ/dK/dV
equal the serial attention's (fp32, 1e-5 of the largest value), and the bytes each rank hands to the CP group
equal the formulas, exactly. Everything also runs under MEGALITE_NCCL_SEMANTICS=1 (``p2p_semantics``),
and the ring's recorded batches replay cleanly under the NCCL checker for c = 2, 3, 4, forward and
backward; a reordered batch is caught. The a2a variant runs the kernel --attention-backend names (the model
hands it over; every choice gives the serial output on CPU).
"""

from __future__ import annotations

import pytest
import torch

from megalite.attention import Documents, blocks, chunk_pieces, core_attention
from megalite.context_parallel import context_parallel_attention, zigzag_index, zigzag_split
from megalite.context_parallel.zigzag import zigzag_chunks
from megalite.parallel.groups import Group, P2POp, ProcessGroups
from megalite.parallel.layout import RankLayout
from megalite.parallel.nccl_check import NcclCheckError, Post, replay
from tests.harness import run_ranks

B, SEQ, D = 2, 32, 8
COMM_TYPES = ["p2p", "a2a", "allgather", "a2a+p2p"]  # a2a+p2p: 2 x (c / 2)
HEADS = {"mha": (4, 4), "gqa": (8, 4)}  # (query heads, query groups): both split 4 ways for a2a
DOCS = [[5, 11, 3, 13], [20, 12]]  # document lengths per batch row: boundaries inside zigzag chunks
CASES = [(h, docs) for h in HEADS for docs in (False, True)]


def segments(b: int = B, seq: int = SEQ) -> torch.Tensor:
    rows = [torch.repeat_interleave(torch.arange(len(d)), torch.tensor(d)) for d in DOCS[:b]]
    assert all(len(r) == seq for r in rows)
    return torch.stack(rows)


def documents(b: int = B, seq: int = SEQ) -> Documents:
    """The same documents as ``segments``, as the data path hands them (cumulative lengths over b x seq)."""
    lengths = torch.tensor([n for d in DOCS[:b] for n in d])
    return Documents.from_cu_seqlens(torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]), b, seq)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor | None) -> torch.Tensor:
    """Full-sequence causal attention: the model's unfused core, or written out with the document mask."""
    if segment_ids is None:
        return core_attention(q, k, v, 0.0, "unfused")
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = q.shape[2]
    allowed = torch.ones(s, s, dtype=torch.bool).tril() & (segment_ids[:, :, None] == segment_ids[:, None, :])
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return scores.masked_fill(~allowed[:, None], float("-inf")).softmax(dim=-1) @ v


def inputs(nq: int, nkv: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, SEQ, D, generator=g) for n in (nq, nkv, nkv, nq)]  # q, k, v, dout


def _compare(rank: int, world: int, fused: bool, row_tile: int) -> dict:
    """Every comm type and case on this rank: worst error against serial and the bytes counted."""
    blocks.FUSED, blocks.ROW_TILE = fused, row_tile
    pg = ProcessGroups.build(RankLayout(world, cp=world, hierarchical_cp=(2, world // 2)), rank)
    out = {}
    for comm in COMM_TYPES:
        for i, (heads, docs) in enumerate(CASES):
            q, k, v, dout = inputs(*HEADS[heads], seed=i)
            seg, packed = (segments(), documents()) if docs else (None, None)
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            reference(*full, seg).backward(dout)
            local = [zigzag_split(t, 2, world, rank).requires_grad_() for t in (q, k, v)]
            pg.comm_bytes.clear()
            got = context_parallel_attention(*local, pg, comm, documents=packed)
            fwd_bytes = dict(pg.comm_bytes)
            got.backward(zigzag_split(dout, 2, world, rank))
            want = [reference(q, k, v, seg)] + [t.grad for t in full]
            errs = {}
            for name, a, w in zip(("out", "dq", "dk", "dv"), [got] + [t.grad for t in local], want):
                w = zigzag_split(w, 2, world, rank)
                errs[name] = (float((a.detach() - w).abs().max()), float(w.abs().max()))
            out[(comm, heads, docs)] = errs, fwd_bytes, dict(pg.comm_bytes)
    return out


@pytest.fixture(scope="module")
def results(p2p_semantics) -> dict[int, list[dict]]:
    # c = 2: the ring's blocks on the CPU flash kernel; c = 4: on the plain path, in pieces of 3 query rows
    # (8 or 4 rows per block here)
    kernels = {2: (True, blocks.ROW_TILE), 4: (False, 3)}
    return {cp: run_ranks(_compare, cp, *kernels[cp], timeout=120) for cp in (2, 4)}


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("comm", COMM_TYPES)
@pytest.mark.parametrize("heads,docs", CASES, ids=lambda x: str(x))
def test_output_and_grads_equal_serial(results, cp, comm, heads, docs):
    for rank, res in enumerate(results[cp]):
        for name, (err, scale) in res[(comm, heads, docs)][0].items():
            assert err <= 1e-5 * max(scale, 1.0), f"rank {rank} {name}: max error {err:.2e} (largest value {scale:.2f})"


def expected_bytes(comm: str, cp: int, nq: int, nkv: int) -> tuple[dict, dict]:
    """docs/parallelism.md's formulas: (forward, forward + backward) bytes by (group, label), fp32."""
    s, e = SEQ // cp, 4
    kv = 2 * B * nkv * s * D * e  # one rank's K and V chunk
    if comm == "p2p":  # K/V c-1 times forward; K/V and the fp32 dK/dV c-1 times each backward
        return {("cp", "send"): (cp - 1) * kv}, {("cp", "send"): 3 * (cp - 1) * kv}
    if comm == "a2a":
        qkv, o = (nq + 2 * nkv) * B * s * D * e, nq * B * s * D * e
        fwd = {("cp", "all_to_all qkv"): qkv, ("cp", "all_to_all out"): o}
        return fwd, {**fwd, ("cp", "all_to_all out backward"): o, ("cp", "all_to_all qkv backward"): qkv}
    if comm == "a2a+p2p":  # the all-to-all over a = 2 ranks, then the ring over c / 2
        n = cp // 2
        qkv, o = (nq + 2 * nkv) * B * s * D * e, nq * B * s * D * e
        fwd = {("cp_a2a", "all_to_all qkv"): qkv, ("cp_a2a", "all_to_all out"): o}
        total = {**fwd, ("cp_a2a", "all_to_all out backward"): o, ("cp_a2a", "all_to_all qkv backward"): qkv}
        if n > 1:
            fwd[("cp_ring", "send")], total[("cp_ring", "send")] = (n - 1) * kv, 3 * (n - 1) * kv
        return fwd, total
    fwd = {("cp", "all_gather kv"): cp * kv}
    return fwd, {**fwd, ("cp", "reduce_scatter dkv"): cp * kv}


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("comm", COMM_TYPES)
def test_bytes_equal_the_formula(results, cp, comm):
    for heads, docs in CASES:
        fwd, total = expected_bytes(comm, cp, *HEADS[heads])
        for rank, res in enumerate(results[cp]):
            _, got_fwd, got_total = res[(comm, heads, docs)]
            assert (got_fwd, got_total) == (fwd, total), f"rank {rank} {heads} docs={docs}"


# ---- the ring under the NCCL replay checker ---------------------------------------------------------
def record_ring(cp: int, seq: int = 24, backward: bool = True) -> tuple[list[list], list[ProcessGroups]]:
    """Every CP rank's recorded batches of one ring attention (forward and backward), no communication."""
    logs, pgs = [], []
    for rank in range(cp):
        pg = ProcessGroups.unconnected(RankLayout(cp, cp=cp), rank, record=True)
        q, k, v = (torch.zeros(1, n, seq // cp, D, requires_grad=True) for n in (4, 2, 2))
        out = context_parallel_attention(q, k, v, pg, "p2p", documents=Documents.whole(1, seq))
        if backward:
            out.sum().backward()
        logs.append(pg.p2p_log)
        pgs.append(pg)
    return logs, pgs


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("backward", [False, True])
def test_recorded_ring_is_nccl_safe(cp, backward):
    logs, pgs = record_ring(cp, backward=backward)
    posts = [[e for e in log if isinstance(e, Post)] for log in logs]
    assert [len(p) for p in posts] == [(cp - 1) * (3 if backward else 1)] * cp
    assert all(p.comm == "cp:" + ",".join(map(str, range(cp))) for log in posts for p in log)
    replay(logs)
    kv = 2 * 2 * (24 // cp) * D * 4
    assert all(pg.comm_bytes == {(Group.CP, "send"): (cp - 1) * kv * (3 if backward else 1)} for pg in pgs)


def test_checker_catches_a_reordered_ring_batch():
    logs, _ = record_ring(3)
    posts = [i for i, e in enumerate(logs[0]) if isinstance(e, Post)]
    a, b = posts[-3], posts[-2]  # rank 0 posts its backward's dK/dV batch of step 2 before the K/V batch
    logs[0][a], logs[0][b] = logs[0][b], logs[0][a]
    # same shapes: NCCL would hand K/V over as dK/dV without a word
    with pytest.raises(NcclCheckError, match=r"sent as dkv step 2 \[2, 1, 2, 8, 8\] but received as kv step 2"):
        replay(logs)


# ---- attention dropout in the ring ------------------------------------------------------------------
P_DROP = 0.3


def _ring_dropout(rank: int, world: int) -> dict:
    """The ring with dropout against serial attention under the same masks: the ring draws one mask per
    piece in piece order (``chunk_pieces``); here they are drawn again and put at the keys' global positions."""
    pg = ProcessGroups.build(RankLayout(world, cp=world), rank) if world > 1 else ProcessGroups.single()
    nq, nkv = HEADS["gqa"]
    q, k, v, dout = inputs(nq, nkv, seed=3)
    seg, packed, s_local = segments(), documents(), SEQ // world
    pos = [zigzag_index(SEQ, world, j) for j in range(world)]
    local = [zigzag_split(t, 2, world, rank).requires_grad_() for t in (q, k, v)]
    torch.manual_seed(11 + rank)
    got = context_parallel_attention(*local, pg, "p2p", dropout_p=P_DROP, documents=packed)
    after_forward = torch.get_rng_state()
    got.backward(zigzag_split(dout, 2, world, rank))
    torch.manual_seed(11 + rank)
    keep = torch.zeros(B, nq, s_local, SEQ)
    for step in range(world):
        j = (rank - step) % world
        for pc in chunk_pieces(packed, zigzag_chunks(rank, world, s_local), zigzag_chunks(j, world, s_local)):
            n = len(range(B)[pc.batch])
            shape = (n, nq, pc.q1 - pc.q0, pc.k1 - pc.k0)
            drawn = (torch.rand(shape) >= P_DROP).float() / (1 - P_DROP)
            rows = torch.arange(pc.q0, pc.q1)
            keep[pc.batch, :, rows[:, None], pos[j][pc.k0:pc.k1][None, :]] = drawn
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    qr, kf, vf = full[0][:, :, pos[rank]], *(t.repeat_interleave(nq // nkv, dim=1) for t in full[1:])
    allowed = (torch.arange(SEQ)[None, :] <= pos[rank][:, None]) & (seg[:, pos[rank], None] == seg[:, None, :])
    scores = (qr @ kf.transpose(-1, -2) / D ** 0.5).masked_fill(~allowed[:, None], float("-inf"))
    want = (scores.softmax(dim=-1) * keep) @ vf
    want.backward(zigzag_split(dout, 2, world, rank))
    grads = [full[0].grad] + [pg.all_reduce(t.grad, Group.CP) if world > 1 else t.grad for t in full[1:]]
    errs = {name: float((a.detach() - zigzag_split(w, 2, world, rank)).abs().max())
            for name, a, w in zip(("dq", "dk", "dv"), [t.grad for t in local], grads)}
    errs["out"] = float((got - want).detach().abs().max())
    errs["rng"] = float(not torch.equal(torch.get_rng_state(), after_forward))  # backward replays, then restores
    plain = context_parallel_attention(*local, pg, "p2p", documents=packed)
    errs["dropped"] = float((got - plain).detach().abs().max())
    return errs


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_ring_dropout_merges_exactly(cp):
    results = [_ring_dropout(0, 1)] if cp == 1 else run_ranks(_ring_dropout, cp, timeout=120)
    for rank, errs in enumerate(results):
        assert errs["dropped"] > 0.1, "dropout changed nothing"
        assert errs["rng"] == 0.0, "the backward left the generator elsewhere than the forward did"
        for name in ("out", "dq", "dk", "dv"):
            assert errs[name] <= 2e-5, f"rank {rank} {name}: {errs[name]:.2e}"


# ---- single-process properties ---------------------------------------------------------------------
def test_zigzag_index_balances_the_causal_work():
    assert zigzag_index(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_index(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    every = torch.cat([zigzag_index(24, 3, r) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))
    work = [int((zigzag_index(24, 3, r) + 1).sum()) for r in range(3)]  # keys seen by the rank's queries
    assert len(set(work)) == 1
    x = torch.arange(24).reshape(1, 24)
    assert torch.equal(zigzag_split(x, 1, 3, 2)[0], zigzag_index(24, 3, 2))


@pytest.mark.parametrize("fused", [True, False], ids=["cpu_flash_kernel", "plain"])
def test_ring_kernels_and_row_pieces(fused, monkeypatch):
    """Both block kernels, in pieces of 5 query rows (uneven), equal serial attention with documents."""
    monkeypatch.setattr(blocks, "FUSED", fused)
    monkeypatch.setattr(blocks, "ROW_TILE", 5)
    q, k, v, dout = inputs(8, 2, seed=5)
    seg = segments()
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    got = context_parallel_attention(*full, ProcessGroups.single(), "p2p", documents=documents())
    got.backward(dout)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = reference(*ref, seg)
    want.backward(dout)
    for a, w in zip([got] + [t.grad for t in full], [want] + [t.grad for t in ref]):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-5)


def test_cp1_is_serial_attention_with_documents():
    q, k, v, _ = inputs(8, 2, seed=7)
    seg = segments()
    for comm in COMM_TYPES:
        got = context_parallel_attention(q, k, v, ProcessGroups.single(), comm, documents=documents())
        torch.testing.assert_close(got, reference(q, k, v, seg), rtol=1e-5, atol=1e-5)


BACKENDS = ("auto", "flash", "fused", "unfused", "local", "sdpa")  # --attention-backend's choices


def test_a2a_runs_the_attention_backend(monkeypatch):
    # The a2a variant's full-sequence attention is the one-rank core: it gets the backend it is handed.
    from megalite.attention import core

    seen, causal = [], core._causal
    monkeypatch.setattr(core, "_causal", lambda *a: seen.append(a[4]) or causal(*a))
    q, k, v, _ = inputs(8, 2, seed=3)
    for backend in BACKENDS:
        seen.clear()
        got = context_parallel_attention(q, k, v, ProcessGroups.single(), "a2a", backend=backend)
        assert seen == [backend]
        torch.testing.assert_close(got, reference(q, k, v, None), rtol=1e-5, atol=1e-5)


def test_the_model_hands_its_attention_backend_to_context_parallel(monkeypatch):
    from megalite.config.model import ModelConfig
    from megalite.model import attention_core, transformer
    from megalite.tensor_parallel.context import BuildContext
    from megalite.tensor_parallel.random import RNGTracker

    seen = []

    def recorded(q, k, v, pg, comm_type, **kw):
        seen.append((comm_type, kw["backend"]))
        return torch.zeros_like(q)

    monkeypatch.setattr(attention_core, "context_parallel_attention", recorded)  # the layers' one core call
    pg = ProcessGroups.unconnected(RankLayout(2, cp=2), 0)  # no collective runs: TP 1, the CP core recorded
    for backend in BACKENDS:
        cfg = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=4, seq_length=16,
                          attention_backend=backend)
        attn = transformer.Attention(cfg, BuildContext(pg, RNGTracker(), cp_comm_types=("a2a",)))
        attn.eval()(torch.randn(8, 2, 16), None)
        assert seen.pop() == ("a2a", backend)


def test_bad_input_is_named():
    q, k, v, _ = inputs(4, 2, seed=0)
    pg = ProcessGroups.unconnected(RankLayout(4, cp=4), 0)
    local = [t[:, :, :8] for t in (q, k, v)]
    with pytest.raises(ValueError, match="--cp-comm-type a2a.*--context-parallel-size 4.*--num-query-groups"):
        context_parallel_attention(*local, pg, "a2a")
    with pytest.raises(ValueError, match="--cp-comm-type 'ring'"):
        context_parallel_attention(*local, pg, "ring")
    with pytest.raises(ValueError, match="--seq-length 12 .*--context-parallel-size"):
        zigzag_index(12, 4, 0)


def test_p2p_travels_on_pipeline_or_cp_groups_only():
    pg = ProcessGroups.unconnected(RankLayout(4, tp=2, cp=2), 0, record=True)
    with pytest.raises(ValueError, match="point-to-point messages travel on the pp, cp or cp_ring group, not tp"):
        pg.post_p2p([P2POp("send", torch.zeros(1), 1)], kind=Group.TP)
    pg.post_p2p([P2POp("send", torch.zeros(1), 1, "x")], kind=Group.CP)
    assert pg.p2p_log[0].comm == "cp:0,2" and pg.p2p_log[0].ops[0].peer == 2
