"""Promises of --decoupled-lr / --decoupled-min-lr (Megatron's meaning): the input word embedding and
the output layer (only these: not the position embedding) take their own peak and final rate in the
schedule every other parameter follows (tests/test_lr_schedule.py checks the rates against megatron-core):
- with --decoupled-lr 0 (and --decoupled-min-lr 0) the embedding and output weights stay fixed while
  everything else trains;
- DP=2 with the distributed optimizer, whose shards span both kinds of parameter, trains on the
  single-process curve, and resumes from its checkpoint bitwise as an uninterrupted run does;
- bad values are refused naming the flag."""

from __future__ import annotations

import pytest
import torch

from megalite.config import ConfigError, validate
from megalite.config.arguments import MegaliteConfig
from megalite.config.model import ModelConfig
from megalite.model.build import build_model
from megalite.model.gpt import GPTModel
from megalite.optimizer.optimizer import param_groups
from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.param_meta import param_meta
from megalite.tensor_parallel.random import RNGTracker, model_parallel_seed
from megalite.training.loop import TrainResult, pretrain
from tests.asserts import assert_rel_close
from tests.layouts import layout_curves, serial_curve
from tests.tp_utils import GPT2, groups_for, mock_data

VOCAB = 200
SEQ = 16
MODEL = {**GPT2, "untie_embeddings_and_output_weights": True}  # word + position embedding, own output layer
DECOUPLED = {"decoupled_lr": 1e-2, "decoupled_min_lr": 1e-3}
QUIET = lambda s: None  # noqa: E731


def flat(iters: int = 6, **extra) -> dict:
    return dict(MODEL, micro_batch_size=1, global_batch_size=4, train_iters=iters, lr=3e-3, min_lr=3e-4,
                lr_warmup_iters=2, lr_decay_iters=8, log_interval=5, eval_iters=0, eval_interval=1000, mock_data=True,
                vocab_size=VOCAB, seed=1234, **extra)


def make_cfg(iters: int = 6, **extra) -> MegaliteConfig:
    return MegaliteConfig.from_flat(flat(iters, **extra))


def train(cfg: MegaliteConfig, world: int = 1, rank: int = 0):
    validate(cfg, world)
    return pretrain(cfg, groups_for(world, rank), data=mock_data(VOCAB, SEQ, 1234, 80), log=QUIET)


def marked(model: GPTModel) -> set[str]:
    return {n for n, p in model.named_parameters() if param_meta(p).embedding_or_output}


@pytest.mark.parametrize("tied", [True, False])
def test_only_word_embedding_and_output_layer_are_decoupled(tied):
    cfg = ModelConfig(**{**MODEL, "untie_embeddings_and_output_weights": not tied})
    meta = torch.device("meta")
    pg = groups_for(1, 0)
    whole = GPTModel(cfg, BuildContext(pg, RNGTracker(), device=meta), VOCAB)
    assert marked(whole) == {"embedding.word.weight"} | (set() if tied else {"output_layer.weight"})
    last = GPTModel(cfg, BuildContext(pg, RNGTracker(), device=meta), VOCAB, pre_process=False, layer_numbers=[1])
    assert marked(last) == {"output_layer.weight"}  # a later stage's copy of a tied embedding too
    slices = [(p, p) for p in whole.parameters()]
    o = make_cfg(**DECOUPLED).optimizer
    groups = param_groups(slices, o)
    flagged = [g for g in groups if g["is_decoupled_lr"]]
    assert len(flagged) == 1 and len(flagged[0]["params"]) == (1 if tied else 2)
    assert flagged[0]["weight_decay"] == o.weight_decay
    assert not any(g["is_decoupled_lr"] for g in param_groups(slices, make_cfg().optimizer))


def test_decoupled_lr_zero_freezes_embedding_and_output_only():
    cfg = make_cfg(decoupled_lr=0.0, decoupled_min_lr=0.0)
    validate(cfg, 1)
    (init,) = build_model(cfg, groups_for(1, 0), VOCAB, model_parallel_seed(cfg.training.seed, 0, 0))
    before = dict(init.named_parameters())
    after = dict(train(cfg).chunks[0].named_parameters())
    frozen = {n for n in before if torch.equal(before[n], after[n])}
    assert frozen == {"embedding.word.weight", "output_layer.weight"}, frozen


def _group_kinds(res: TrainResult, pg: ProcessGroups) -> set[bool]:
    """Whether this rank's optimizer shard holds decoupled parameters, plain ones, or both."""
    return {g["is_decoupled_lr"] for g in res.optimizer.adam.param_groups if g["params"]}


def test_dp2_distributed_optimizer_matches_serial_and_resumes(tmp_path):
    dist = dict(DECOUPLED, use_distributed_optimizer=True)
    ck = str(tmp_path / "ck")
    runs = {"dp2": flat(**dist), "save": flat(exit_interval=3, save=ck, **dist), "resumed": flat(load=ck, **dist)}
    curves = layout_curves(2, runs, extract={"dp2": _group_kinds}, timeout=300)
    serial = serial_curve(flat(**DECOUPLED))
    assert any(abs(a - b) > 1e-6 for a, b in zip(serial_curve(flat()).losses, serial.losses)), \
        "the decoupled rate changed nothing"
    for rank, r in enumerate(curves):
        losses, norms = r["dp2"].losses, r["dp2"].grad_norms
        assert_rel_close(losses, serial.losses, 1e-5, f"rank {rank}: DP2 distributed optimizer vs serial")
        assert_rel_close(norms, serial.grad_norms, 1e-5, f"rank {rank}: grad norm vs serial")
        assert r["dp2"].extra == {True, False}, f"rank {rank}: its shard should span both kinds of parameter"
        assert r["resumed"].losses == losses[3:], f"rank {rank}: resumed run differs from the uninterrupted one"


@pytest.mark.parametrize("flags,message", [
    ({"decoupled_min_lr": 1e-4}, "--decoupled-min-lr needs --decoupled-lr"),
    ({"decoupled_lr": 1e-4, "decoupled_min_lr": 2e-4}, "need 0 <= --decoupled-min-lr (0.0002) <= --decoupled-lr"),
    ({"decoupled_lr": 1e-4}, "--min-lr (0.0003, the default of --decoupled-min-lr) <= --decoupled-lr (0.0001)"),
    ({"decoupled_lr": -1.0, "decoupled_min_lr": 0.0},
     "--decoupled-lr must be a finite number >= 0 that fp32 holds (0, or 1.2e-38 to 3.4e38 in size), got -1.0"),
])
def test_bad_decoupled_rates_are_refused(flags, message):
    with pytest.raises(ConfigError) as e:
        validate(make_cfg(**flags), 1)
    assert message in str(e.value)
