"""Promise (attention/window.py): sliding-window attention (--window-size LEFT 0, a query sees itself and the
LEFT keys before it, inside its document) equals the masked reference on every path, and its cost follows
the window.

- the serial core on every --attention-backend (blockwise on the SDPA ones, the masked softmax on
  'unfused'/'local'), MHA and GQA, with and without packed documents, on the CPU flash kernel and on the
  plain path, tiles small enough that every kind of piece occurs: output and dQ/dK/dV at 1e-5;
- the pieces hold exactly the window's query-key pairs (nothing outside it is computed: the cost follows the
  window), and their count for s = 8192, W = 1024 is below a quarter of the causal s(s+1)/2;
- context parallelism (CP 2: p2p, a2a, allgather; CP 4: a2a+p2p too) with window and documents equals
  the reference, on real gloo ranks;
- --window-attn-skip-freq's per-layer pattern (Megatron's rule) and the refusals of bad flags;
- the generation KV cache of a windowed layer holds at most window - 1 positions and decodes as the whole
  sequence's attention does.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from megalite.attention import Documents, blocks, core_attention
from megalite.attention import window as win
from megalite.config.model import ModelConfig
from megalite.config.validate import window_errors
from megalite.context_parallel import context_parallel_attention, zigzag_index, zigzag_split
from megalite.inference.kv_cache import KVCache
from megalite.parallel.groups import ProcessGroups
from megalite.parallel.layout import RankLayout
from tests.harness import run_ranks

LENGTHS = [[7, 16, 1, 8], [3, 29]]  # per sample: a one-token document, boundaries inside tiles and chunks


def packed(lengths: list[list[int]] = LENGTHS) -> Documents:
    cu = [0, *itertools.accumulate(n for row in lengths for n in row)]
    return Documents.from_cu_seqlens(torch.tensor(cu), len(lengths), sum(lengths[0]))


def reference(q, k, v, docs: Documents | None, window: int) -> torch.Tensor:
    """Written out: the causal mask, the documents' and the window's, one softmax."""
    b, h, s, _ = q.shape
    rep = h // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None]
    allowed = ((j <= i) & (j > i - window)).expand(b, s, s).clone()
    if docs is not None:
        for bi, e in enumerate(docs.bounds):
            doc = torch.zeros(s, dtype=torch.long)
            for n, (a, c) in enumerate(zip(e, e[1:])):
                doc[a:c] = n
            allowed[bi] &= doc[:, None] == doc[None]
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    return scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1) @ v


def _inputs(nq: int, nkv: int, s: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, n, s, 8, generator=g) for n in (nq, nkv, nkv, nq)]


def _check(got, want, grads, want_grads):
    for a, w in zip([got, *grads], [want, *want_grads]):
        assert (a - w).abs().max() <= 1e-5 * max(1.0, float(w.abs().max()))


@pytest.mark.parametrize("window,tile", [(8, 512), (8, 3), (5, 2), (1, 512), (2, 512), (31, 512), (12, 5)])
@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_serial_core_equals_masked_reference(monkeypatch, window, tile, docs, fused, heads):
    monkeypatch.setattr(win, "TILE", tile)
    monkeypatch.setattr(blocks, "FUSED", fused)
    q, k, v, dout = _inputs(*heads)
    packed_docs = packed() if docs else None
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = reference(*full, packed_docs, window)
    want.backward(dout)
    for backend in ("auto", "flash", "fused", "unfused", "local", "sdpa"):
        mine = [t.clone().requires_grad_() for t in (q, k, v)]
        got = core_attention(*mine, 0.0, backend, packed_docs, window)
        got.backward(dout)
        _check(got.detach(), want.detach(), [t.grad for t in mine], [t.grad for t in full])


def test_old_core_ignores_no_window():
    """The option is not silently dropped: with a window the result differs from full causal attention."""
    q, k, v, _ = _inputs(4, 4)
    assert (core_attention(q, k, v, 0.0, "auto", window=4) - core_attention(q, k, v, 0.0, "auto")).abs().max() > 1e-3


@pytest.mark.parametrize("tile", [3, 8, 512])
def test_pieces_hold_exactly_the_window(monkeypatch, tile):
    """Every query-key pair the pieces compute is inside the window and document, each exactly once."""
    monkeypatch.setattr(win, "TILE", tile)
    for docs in (Documents.whole(1, 40), packed([[7, 16, 1, 16]])):
        for window in (1, 2, 5, 9, 17, 40):
            d = docs.with_window(window)
            seen = torch.zeros(40, 40, dtype=torch.long)
            for p in d.pieces(0, 40, 0, 40):
                allowed = torch.ones(p.q1 - p.q0, p.k1 - p.k0, dtype=torch.bool)
                if p.causal or p.flip:
                    allowed = allowed.tril() if p.causal else allowed.triu()
                if p.window:
                    allowed = blocks.band_allowed(p.q1 - p.q0, p.k1 - p.k0, (p.lag, p.window))
                assert allowed.any(dim=1).all(), "every row of a piece sees a key"
                seen[p.q0:p.q1, p.k0:p.k1] += allowed.long()
            i, j = torch.arange(40)[:, None], torch.arange(40)[None]
            doc = torch.zeros(40, dtype=torch.long)
            for n, (a, c) in enumerate(zip(docs.bounds[0], docs.bounds[0][1:])):
                doc[a:c] = n
            want = ((j <= i) & (j > i - window) & (doc[:, None] == doc[None])).long()
            assert torch.equal(seen, want), (window, tile)
            assert d.work() == int(want.sum())


def test_cost_follows_the_window():
    """s = 8192, W = 1024: the pairs computed are those of the window, under a quarter of causal attention's."""
    s, w = 8192, 1024
    d = Documents.whole(1, s, window=w)
    assert d.work() == s * w - w * (w - 1) // 2
    assert d.work() <= 0.25 * s * (s + 1) // 2


# ---- context parallelism ------------------------------------------------------------------------
def _cp(rank: int, world: int, comms: list[str], window: int) -> dict:
    pg = ProcessGroups.build(RankLayout(world, cp=world, hierarchical_cp=(2, world // 2)), rank)
    out = {}
    for comm, docs, heads in itertools.product(comms, (False, True), ((4, 4), (8, 4))):
        q, k, v, dout = _inputs(*heads, seed=3)
        d = packed() if docs else None
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        want = reference(*full, d, window)
        want.backward(dout)
        local = [zigzag_split(t, 2, world, rank).requires_grad_() for t in (q, k, v)]
        docs_w = (d or Documents.whole(2, 32)).with_window(window)
        pg.comm_bytes.clear()
        got = context_parallel_attention(*local, pg, comm, documents=docs_w)
        fwd = dict(pg.comm_bytes)
        got.backward(zigzag_split(dout, 2, world, rank))
        err = max(float((a.detach() - zigzag_split(w.detach(), 2, world, rank)).abs().max())
                  for a, w in zip([got, *[t.grad for t in local]], [want, *[t.grad for t in full]]))
        out[(comm, docs, heads)] = err, fwd, dict(pg.comm_bytes)
    return out


def ring_positions(c: int, r: int, docs: Documents, window: int) -> tuple[int, int]:
    """docs/design.md's formula, from the masks alone: (K/V positions rank r sends in the forward, dK/dV
    positions it sends in the backward). keep(t, j): owner j's positions that a member among j+t, ..., j+c-1
    attends to; r sends keep(t + 1, r - t) for t = 0..c-2 (forward and again in the backward) and owner
    r - t's dK/dV in the layout keep(1, r - t) for t = 1..c-1."""
    s = docs.seq_length
    i, j = torch.arange(s)[:, None], torch.arange(s)[None]
    masks = []  # per sample: a message carries what any sample needs
    for bounds in docs.bounds:
        doc = torch.zeros(s, dtype=torch.long)
        for n, (a, b) in enumerate(zip(bounds, bounds[1:])):
            doc[a:b] = n
        masks.append((j <= i) & (j > i - window) & (doc[:, None] == doc[None]))
    held = [zigzag_index(s, c, m) for m in range(c)]

    def keep(t: int, o: int) -> int:
        sees = torch.zeros(s, dtype=torch.bool)
        for u in range(t, c):
            for mask in masks:
                sees |= mask[held[(o + u) % c]].any(dim=0)
        return int(sees[held[o]].sum())

    kv = sum(keep(t + 1, (r - t) % c) for t in range(c - 1))
    return kv, sum(keep(1, (r - t) % c) for t in range(1, c))


@pytest.mark.parametrize("world,comms,window", [(2, ["p2p", "a2a", "allgather"], 6),
                                                (4, ["p2p", "a2a", "allgather", "a2a+p2p"], 3)])
def test_context_parallel_equals_reference(world, comms, window):
    for rank, res in enumerate(run_ranks(_cp, world, comms, window, timeout=180)):
        for key, (err, fwd, total) in res.items():
            assert err <= 1e-5, f"rank {rank} {key}: {err:.2e}"
            if key[0] != "p2p":
                continue
            comm, docs, (nq, nkv) = key
            kv_pos, dkv_pos = ring_positions(world, rank, packed() if docs else Documents.whole(1, 32), window)
            per_pos = 2 * 2 * nkv * 8 * 4  # K and V, batch 2, nkv heads, d 8, fp32
            assert fwd == {("cp", "send"): kv_pos * per_pos}, (rank, key, fwd)
            assert total == {("cp", "send"): (2 * kv_pos + dkv_pos) * per_pos}, (rank, key, total)
            full = (world - 1) * (32 // world) * per_pos  # what the ring sends without a window
            assert fwd[("cp", "send")] < full, "the bytes follow the window"


# ---- flags ------------------------------------------------------------------------------------------
def test_layer_pattern_follows_megatron():
    gemma2 = ModelConfig(num_layers=4, window_size=[7, 0], window_attn_skip_freq="2")
    assert gemma2.attention_windows() == [8, 0, 8, 0]  # layer 1 (of 1..4) windowed, layer 2 full, ...
    gemma3 = ModelConfig(num_layers=6, window_size=[7, 0], window_attn_skip_freq="6")
    assert gemma3.attention_windows() == [8, 8, 8, 8, 8, 0]
    listed = ModelConfig(num_layers=3, window_size=[3, 0], window_attn_skip_freq="[0,1,1]")
    assert listed.attention_windows() == [0, 4, 4]
    assert ModelConfig(num_layers=2, window_size=[-1, 0]).attention_windows() == [0, 0]
    assert ModelConfig(num_layers=2).attention_windows() == [0, 0]


@pytest.mark.parametrize("kw,msg", [({"window_size": [7, 2]}, "RIGHT 0"), ({"window_size": [7]}, "two numbers"),
                                    ({"window_attn_skip_freq": "2"}, "needs --window-size"),
                                    ({"window_size": [7, 0], "window_attn_skip_freq": "[1]"}, "each of the 2"),
                                    ({"window_size": [7, 0], "window_attn_skip_freq": "0"}, "positive")])
def test_bad_flags_are_named(kw, msg):
    errors = window_errors(ModelConfig(num_layers=2, **kw))
    assert len(errors) == 1 and msg in errors[0]


# ---- generation ---------------------------------------------------------------------------------
def test_kv_cache_keeps_the_window():
    window, s = 5, 23
    q, k, v, _ = _inputs(4, 2, s=s)
    want = reference(q, k, v, None, window)
    cache = KVCache(capacity=s)
    layer = cache.layer(0)
    got = []
    for a, b in ((0, 9), *((i, i + 1) for i in range(9, s))):  # a prefill longer than the window, then tokens
        kk, vv = layer.update(k[:, :, a:b], v[:, :, a:b], window)
        got.append(core_attention(q[:, :, a:b], kk, vv, 0.0, "auto", window=window))
        cache.advance(b - a)
        assert layer.held <= window - 1
    assert (torch.cat(got, dim=2) - want).abs().max() <= 1e-5


def test_layer_pattern_equals_megatron_cores():
    """megatron-core's own rule (is_layer_window_attention, layers counted from 1) gives the same layers."""
    utils = pytest.importorskip("megatron.core.transformer.utils")
    for freq, text in ((None, None), (2, "2"), (3, "3"), ([1, 1, 0, 1, 0, 0], "[1,1,0,1,0,0]")):
        ours = ModelConfig(num_layers=6, window_size=[5, 0], window_attn_skip_freq=text).attention_windows()
        theirs = [utils.is_layer_window_attention((5, 0), freq, n + 1) for n in range(6)]
        assert [w > 0 for w in ours] == theirs, freq


@pytest.mark.parametrize("freq,megatron_freq", [(None, None), ("6", 6), ("[1,0]*2", [1, 0, 1, 0])])
def test_megatron_args_carry_the_window(freq, megatron_freq):
    """to-megatron writes Megatron's window_size tuple and skip frequency; from-megatron reads them back."""
    from megalite.checkpointing.megatron.args import config_from_args
    from megalite.checkpointing.megatron.export import megatron_args
    from megalite.checkpointing.metadata import config_dict

    cfg = ModelConfig(num_layers=4, window_size=[7, 0], window_attn_skip_freq=freq)
    args = megatron_args(config_dict(cfg, 128), 128)
    assert args.window_size == (7, 0) and getattr(args, "window_attn_skip_freq", None) == megatron_freq
    back = ModelConfig(**{k: v for k, v in config_from_args(args, 128, "ckpt").items() if k != "vocab_size"})
    assert back.window_size == [7, 0] and back.attention_windows() == cfg.attention_windows()


def test_megatron_window_looking_ahead_is_refused():
    from argparse import Namespace

    from megalite.checkpointing.errors import CheckpointError
    from megalite.checkpointing.megatron.args import config_from_args

    args = Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, window_size=(7, 3))
    with pytest.raises(CheckpointError, match="RIGHT 0"):
        config_from_args(args, 128, "ckpt")


# ---- the planner ------------------------------------------------------------------------------------
def test_planner_counts_the_window():
    """FLOPs per token: a local layer's QK^T and PV span its window (the causal square's s otherwise); the
    layer kinds follow --window-attn-skip-freq; the saved activations are the causal kind's (no s x s term
    added or removed: the blockwise path saves q, k, v, out, lse)."""
    from megalite.planning.flops import flops_per_token
    from megalite.planning.model_shape import ModelShape

    base = dict(num_layers=4, hidden_size=256, num_attention_heads=4)
    full, local = ModelConfig(**base), ModelConfig(**base, window_size=[127, 0], window_attn_skip_freq="2")
    shape = ModelShape.of(local)
    assert [(k.attention, k.window) for k in shape.layers] == [("local", 128), ("causal", 0)] * 2
    s, d = 4096, 64
    per_layer_attn = lambda keys: 2 * 2 * keys * 4 * d  # noqa: E731 (2 FLOPs x QK^T and PV x heads x d)
    assert flops_per_token(full, 1000, s) - flops_per_token(local, 1000, s) == 2 * (
        per_layer_attn(s) - per_layer_attn(128))
    assert ModelShape.of(ModelConfig(**base, window_size=[8191, 0])).layers[0].keys_per_query(s) == s
