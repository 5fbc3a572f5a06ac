"""Megatron-LM's example launch scripts (GPT-3 175B, Llama 3 8B), with only sizes and paths scaled
down, are accepted by pretrain_gpt.py: the flags megalite honours take effect, the ones it ignores are
named in one warning, and the few it refuses (see docs/training.md) are refused by name."""

from __future__ import annotations

import pytest

from megalite.config import parse_args, validate
from tests.cli_utils import launch_pretrain, losses

# examples/gpt3/train_gpt3_175b_distributed.sh, sizes scaled down (its --step-batch-size-schedule is refused).
GPT3 = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
        "--attention-backend auto --micro-batch-size 1 --global-batch-size 4 --train-iters 4 --weight-decay 0.1 "
        "--adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5 "
        "--lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 4 "
        "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --data-path corpus_text_document "
        "--vocab-file vocab.json --merge-file merges.txt --split 949,50,1 --log-interval 100 --save-interval 10000 "
        "--eval-interval 1000 --save ckpt --load ckpt --eval-iters 10 --tensorboard-dir tb").split()

# examples/llama/train_llama3_8b_h100_fp8.sh (mock data), sizes scaled down, every other flag as it has them.
LLAMA3 = ("--use-mcore-models --num-layers 2 --hidden-size 32 --ffn-hidden-size 64 --num-attention-heads 4 "
          "--group-query-attention --num-query-groups 2 --kv-channels 8 --seq-length 16 --max-position-embeddings 16 "
          "--position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 "
          "--hidden-dropout 0.0 --swiglu --normalization RMSNorm --init-method-std 0.0134 --attention-backend fused "
          "--apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1 "
          "--global-batch-size 2 --train-samples 8 --lr-decay-samples 6 --lr-warmup-samples 2 --lr 0.00015 "
          "--min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0 "
          "--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 "
          "--grad-reduce-in-bf16 --cross-entropy-loss-fusion "
          "--calculate-per-token-loss --manual-gc --empty-unused-memory-level 1 --exit-duration-in-mins 235 "
          "--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather "
          "--tensor-model-parallel-size 1 --context-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce "
          "--overlap-param-gather --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
          "--tiktoken-pattern v2 --split 99,1,0 --no-create-attention-mask-in-dataloader --no-mmap-bin-files "
          "--num-workers 1 --log-interval 1 --eval-iters 2 --eval-interval 100 --save-interval 1000 "
          "--log-throughput --ckpt-format torch_dist --distributed-timeout-minutes 60").split()


def test_gpt3_script_flags(capsys):
    cfg = parse_args(GPT3)
    validate(cfg, 1)
    assert cfg.data.tokenizer_type == "GPT2BPETokenizer"  # Megatron's default with --vocab-file/--merge-file
    assert cfg.optimizer.lr_warmup_fraction == pytest.approx(0.001)
    assert "warning" not in capsys.readouterr().err


def test_llama3_script_flags(capsys, tmp_path):
    cfg = parse_args(LLAMA3 + ["--save", str(tmp_path), "--load", str(tmp_path)])
    validate(cfg, 1)
    assert (cfg.training.train_samples, cfg.training.train_iters) == (8, 4)
    assert cfg.model.apply_layernorm_1p
    assert (cfg.optimizer.decoupled_lr, cfg.optimizer.decoupled_min_lr) == (5.0e-4, 4.5e-5)
    err = capsys.readouterr().err
    assert err.count("warning") == 1
    for flag in ["--use-mcore-models", "--fp8-format", "--num-workers"]:
        assert flag in err
    assert "--manual-gc" not in err and "--empty-unused-memory-level" not in err  # honoured (config fields)
    assert cfg.training.manual_gc and cfg.training.empty_unused_memory_level == 1
    assert "--log-throughput" not in err and "--calculate-per-token-loss" not in err  # honoured, not ignored


def test_llama3_script_trains(tmp_path):
    proc = launch_pretrain(LLAMA3 + ["--save", str(tmp_path), "--load", str(tmp_path)])
    found = losses(proc)
    assert sorted(found) == [1, 2, 3, 4]
    assert "accepted and ignored" in proc.stderr and "Traceback" not in proc.stderr
    assert "tokens per second" in proc.stdout  # --log-throughput (the default)


def test_no_log_throughput_leaves_it_off_the_line():
    proc = launch_pretrain(["--mock-data", "--vocab-size", "64", "--train-iters", "1", "--num-layers", "1",
                         "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
                         "--no-log-throughput"], timeout=120)
    assert sorted(losses(proc)) == [1]
    assert "tokens per second" not in proc.stdout and "TFLOP/s" not in proc.stdout


@pytest.mark.parametrize("flag", [["--rampup-batch-size", "16", "16", "100"],
                                  ["--step-batch-size-schedule", "0:16 2.4B:320"]])
def test_refused_megatron_flags(flag):
    with pytest.raises(SystemExit) as e:
        parse_args(LLAMA3 + flag)
    assert e.value.code == 2
