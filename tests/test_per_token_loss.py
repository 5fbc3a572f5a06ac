"""Promises of the loss normalisations (docs/design.md §3.9):
- per micro-batch (the default): the mean over micro-batches of sum(loss x mask) / sum(mask), its gradient
  that mean's; --calculate-per-token-loss: the global batch's sum(loss x mask) over its total unmasked-token
  count, reported and differentiated as such (hand-made batch of a real model);
- a micro-batch with no unmasked token adds 0 (no NaN); a global batch with none gives loss 0, zero gradients;
- evaluation uses the training masks and the same normalisation (per token: over all its batches);
- both modes are layout-independent: DP2 equals serial, with --eod-mask-loss on EOD-separated documents."""

from __future__ import annotations

import math

import pytest
import torch

from megalite.config.arguments import MegaliteConfig
from megalite.config.model import ModelConfig
from megalite.data.mock import MockGPTDataset
from megalite.parallel.groups import ProcessGroups
from megalite.parallel.loss_scaling import LossScaling
from megalite.training.batches import global_batch
from megalite.training.train_step import evaluate, reported_loss, run_microbatches, step_scaling
from tests.layouts import assert_matches_serial, layout_curves, serial_curve
from tests.tp_utils import LLAMA_GQA, build, layout_flat

VOCAB = 64
ITERS = 3


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def config(per_token: bool, **data) -> MegaliteConfig:
    cfg = MegaliteConfig()
    cfg.training.calculate_per_token_loss = per_token
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def model():
    return build(ModelConfig(**LLAMA_GQA), ProcessGroups.single(), VOCAB)


def batches(masks: list[torch.Tensor]) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for mask in masks:
        text = torch.randint(0, VOCAB, (mask.shape[0], mask.shape[1] + 1), generator=gen)
        out.append({"tokens": text[:, :-1], "labels": text[:, 1:], "loss_mask": mask.float()})
    return out


def hand_made_masks() -> list[torch.Tensor]:
    """Two micro-batches of 2 x 16 with 20 and 5 unmasked tokens."""
    a, b = torch.zeros(2, 16), torch.zeros(2, 16)
    a.view(-1)[torch.arange(0, 32, 32 / 20).long()] = 1
    b.view(-1)[[0, 7, 16, 17, 31]] = 1
    return [a, b]


def step(chunk, mbs: list[dict], per_token: bool, forward_only: bool = False) -> float:
    """The training step's loss path: the step's scaling, its normalised micro-batches, the pipeline pass."""
    pg = ProcessGroups.single()
    scaling = step_scaling(config(per_token), pg, mbs)
    return reported_loss(run_microbatches([chunk], scaling.normalised(mbs), pg, scaling, forward_only=forward_only),
                         pg)


def expected(chunk, mbs: list[dict], per_token: bool) -> torch.Tensor:
    sums = [(chunk(mb["tokens"], labels=mb["labels"]).float() * mb["loss_mask"]).sum() for mb in mbs]
    counts = [mb["loss_mask"].sum() for mb in mbs]
    if per_token:
        total = sum(counts)
        return sum(sums) / total if total > 0 else sum(sums) * 0
    return sum(s / c if c > 0 else s * 0 for s, c in zip(sums, counts)) / len(mbs)


def test_per_token_divisor_is_the_global_batch_mean_count_per_micro_batch():
    """T = 120 tokens over m = 3 micro-batches on each of 2 DP ranks (CP 2): each loss sum is divided by 20."""
    s = LossScaling(3, cp=2, grad_size=4, global_tokens=torch.tensor([120.0], dtype=torch.float64))
    mbs = s.normalised([{"loss_mask": torch.ones(2, 4), "num_tokens": torch.tensor(8.0)}] * 3)
    assert [float(mb["num_tokens"]) for mb in mbs] == [20.0] * 3 and mbs[0]["num_tokens"].dtype == torch.float32
    plain = [{"loss_mask": torch.ones(2, 4)}]
    assert LossScaling(3).normalised(plain) == plain  # per micro-batch: each keeps its own count


def grads(chunk) -> list[torch.Tensor]:
    return [p.grad.clone() for p in chunk.parameters()]


@pytest.mark.parametrize("per_token", [False, True])
def test_hand_made_batch_loss_and_gradient(per_token):
    chunk, mbs = model(), batches(hand_made_masks())
    loss = step(chunk, mbs, per_token)
    got = grads(chunk)
    chunk.zero_grad()
    want = expected(chunk, mbs, per_token)
    want.backward()
    assert loss == pytest.approx(float(want.detach()), rel=1e-6)
    assert any(g.abs().max() > 0 for g in got)
    for g, w in zip(got, grads(chunk)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-8)


def test_the_two_modes_differ_when_counts_differ_and_agree_when_equal():
    chunk = model().eval()
    with torch.no_grad():
        mbs = batches(hand_made_masks())
        assert abs(step(chunk, mbs, True, True) - step(chunk, mbs, False, True)) > 1e-3
        equal = batches([torch.ones(2, 16), torch.ones(2, 16)])
        assert step(chunk, equal, True, True) == step(chunk, equal, False, True)  # bitwise: same divisor


@pytest.mark.parametrize("per_token", [False, True])
def test_a_micro_batch_without_tokens_adds_zero(per_token):
    chunk = model()
    mbs = batches([hand_made_masks()[0], torch.zeros(2, 16)])
    loss = step(chunk, mbs, per_token)
    assert math.isfinite(loss) and all(torch.isfinite(g).all() for g in grads(chunk))
    chunk.zero_grad()
    with torch.no_grad():
        first = expected(chunk, mbs[:1], per_token)
    assert loss == pytest.approx(float(first) / (1 if per_token else 2), rel=1e-6)


@pytest.mark.parametrize("per_token", [False, True])
def test_a_global_batch_without_tokens_gives_zero_loss_and_gradient(per_token):
    chunk = model()
    loss = step(chunk, batches([torch.zeros(2, 16), torch.zeros(2, 16)]), per_token)
    assert loss == 0.0
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads(chunk))


@pytest.mark.parametrize("per_token", [False, True])
def test_evaluation_uses_the_masks_and_the_normalisation(per_token):
    cfg = config(per_token, eod_mask_loss=True)
    cfg.training.global_batch_size, cfg.training.micro_batch_size, cfg.training.eval_iters = 4, 2, 3
    cfg.model = ModelConfig(**LLAMA_GQA)
    data = MockGPTDataset(40, 16, VOCAB, seed=2, eod=VOCAB - 1)
    chunk, pg = model().eval(), ProcessGroups.single()
    got = evaluate([chunk], data, 4, cfg, pg, VOCAB - 1)
    with torch.no_grad():
        mbs = [mb for k in range(3) for mb in global_batch(data, 4 + 4 * k, cfg, pg, torch.device("cpu"), VOCAB - 1)]
        assert len({int(mb["loss_mask"].sum()) for mb in mbs}) > 1, "the masks must differ"
        want = expected(chunk, mbs, per_token)
    assert got == pytest.approx(float(want), rel=1e-6)


# ---- layout independence -----------------------------------------------------------------------------------


def flat(per_token: bool) -> dict:
    return layout_flat(LLAMA_GQA, vocab=VOCAB, iters=ITERS, micro_batch_size=2, eval_iters=1, eval_interval=2,
                       eod_mask_loss=True, reset_position_ids=True, calculate_per_token_loss=per_token)


@pytest.fixture(scope="module")
def dp2() -> list[dict]:
    return layout_curves(2, {"micro": flat(False), "token": flat(True)})


@pytest.mark.parametrize("mode", ["micro", "token"])
def test_dp2_equals_serial(dp2, mode):
    ref = serial_curve(flat(mode == "token"))
    assert_matches_serial(dp2, mode, ref, ITERS)
    for rank in range(2):
        got = dp2[rank][mode].valid_losses
        assert [s for s, _ in got] == [s for s, _ in ref.valid_losses] == [2, 3]
        for (_, a), (_, b) in zip(got, ref.valid_losses):
            assert a == pytest.approx(b, rel=1e-5)


def test_per_token_differs_from_per_micro_batch_on_these_masks():
    a, b = serial_curve(flat(True)), serial_curve(flat(False))
    assert abs(a.losses[0] - b.losses[0]) > 1e-4
