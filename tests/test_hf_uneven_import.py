"""Promise (docs/parallelism.md, "Uneven pipeline stages"): ``convert_checkpoint.py from-hf`` with
--decoder-first/last-pipeline-num-layers writes the uneven split it names (the metadata's chunk_layers),
and the checkpoint loaded at that layout gives the Hugging Face model's logits."""

from __future__ import annotations

import json
import os

import torch

from tests.harness import run_ranks
from tests.test_hf_conversion import SEQ, TOKENS, VOCAB, _assert_close, _perturbed, convert

LAYERS, PP = 8, 4
SPLIT = {"decoder_first_pipeline_num_layers": 1, "decoder_last_pipeline_num_layers": 3}  # 1, 2, 2, 3


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None))


def _uneven_logits(rank: int, world: int, load: str) -> torch.Tensor | None:
    """The imported checkpoint loaded at PP 4 with the uneven split; the logits on the last stage."""
    from megalite.inference.loading import load_model, plan
    from megalite.inference.pipeline import pipeline_forward
    from megalite.launch.run import build_groups

    p = plan({"load": load, "pipeline_model_parallel_size": PP, **SPLIT, "tokenizer_type": "NullTokenizer",
              "vocab_size": VOCAB - 1}, world)  # NullTokenizer adds its EOD
    pg = build_groups(p.cfg, world, rank)
    return pipeline_forward(load_model(p, pg), pg, TOKENS)


def test_from_hf_with_split_flags_writes_the_uneven_layout_and_gives_the_hf_logits(tmp_path):
    model = _perturbed(_llama())
    folder, save = str(tmp_path / "hf"), str(tmp_path / "imported")
    model.save_pretrained(folder)
    with torch.no_grad():
        want = model(TOKENS).logits
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SPLIT.items()]
    assert convert(["from-hf", "--load", folder, "--save", save, "--pipeline-model-parallel-size", str(PP),
                    *flags]) == 0
    iteration = open(os.path.join(save, "latest_checkpointed_iteration.txt")).read().strip()
    meta = json.load(open(os.path.join(save, f"iter_{int(iteration):07d}", "metadata.json")))["layout"]
    assert meta["chunk_layers"] == [[[0]], [[1, 2]], [[3, 4]], [[5, 6, 7]]], meta
    got = [r for r in run_ranks(_uneven_logits, PP, save, timeout=300) if r is not None]
    assert len(got) == 1
    _assert_close(got[0], want, "from-hf at PP 4, first 1 / last 3")
