"""The MoE dispatch bytes formula of docs/moe.md (tests/moe_formulas.py) holds to the byte on a real
2-rank EP2 run, for both dispatchers and alltoall padded to the capacity (bench/bench_moe.py runs the
larger layouts)."""

from __future__ import annotations

from collections import Counter

from tests.harness import run_ranks
from tests.moe_bytes_run import ITERS, MOE_LABELS, bytes_cfg, formula
from tests.tp_utils import mock_data

CASES = [("EP2", 2, 1, 2, 1, "alltoall", False), ("EP2", 2, 1, 2, 1, "alltoall", True),
         ("EP2", 2, 1, 2, 1, "allgather", False)]


def _worker(rank: int, world: int) -> list[Counter]:
    from megalite.parallel.groups import ProcessGroups
    from megalite.parallel.layout import RankLayout
    from megalite.training.loop import pretrain

    out = []
    for _, w, tp, ep, etp, disp, pad in CASES:
        pg = ProcessGroups.build(RankLayout(world, tp, ep=ep, etp=etp), rank)
        pretrain(bytes_cfg(w, tp, ep, etp, disp, pad), pg, data=mock_data(512, 32, 1234, 64), log=lambda s: None)
        out.append(Counter({k: v // ITERS for k, v in pg.comm_bytes.items() if k[1] in MOE_LABELS}))
    return out


def test_dispatch_bytes_match_the_formula():
    ranks = run_ranks(_worker, 2)
    for i, case in enumerate(CASES):
        want, even = formula(case)
        got = sum((r[i] for r in ranks), Counter())
        assert got == want, (case, got, want)
        assert want, case  # the formula names the collectives the run made
        if even:
            for r in ranks:
                assert r[i] == Counter({k: v // 2 for k, v in want.items()}), case
