"""Promise: a Hugging Face export loads with transformers 4.x as well as 5.x.
- tokenizer_config.json names ``PreTrainedTokenizerFast`` (5.x writes ``TokenizersBackend``, unknown to
  4.x) and ``model_max_length`` is the model's positions;
- bos/eos ids are the end-of-document id in config.json and generation_config.json;
- a Llama export also writes ``rope_theta`` (4.x does not read ``rope_parameters``);
- ``reshard`` keeps the checkpoint's tokenizer entry, so its output still exports the tokenizer;
- with MEGALITE_OLD_TRANSFORMERS_PYTHON set to a Python whose transformers is 4.x (torch shared), the
  export loads there and gives the same tokens and logits (docs/checkpoints.md says how to make one)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from megalite.checkpointing.hf.convert import to_hf_config
from megalite.checkpointing.metadata import config_dict
from megalite.config.model import ModelConfig
from megalite.data.tokenizer_training import train_bpe
from tests.cli_utils import ROOT, launch_pretrain, load_tool

OLD_PYTHON = os.environ.get("MEGALITE_OLD_TRANSFORMERS_PYTHON")
POSITIONS = 16
TEXT = "the cat sat on the mat<|endoftext|> the dog"
PROBE = """import json, sys, torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1], local_files_only=True)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], local_files_only=True).eval()
ids = tok.encode(sys.argv[2], add_special_tokens=False)
with torch.no_grad():
    logits = model(torch.tensor([ids])).logits[0].tolist()
print(json.dumps({"version": transformers.__version__, "class": type(tok).__name__, "ids": ids,
                  "max": tok.model_max_length, "gen": [model.generation_config.bos_token_id,
                  model.generation_config.eos_token_id], "logits": logits}))
"""


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> dict:
    """GPT-2 trained 2 iterations with a BPE tokenizer, resharded to TP=2, exported from the reshard."""
    root = tmp_path_factory.mktemp("hf_compat")
    bpe = train_bpe(["the cat sat on the mat, and the dog sat on the log. " * 20], 300, str(root / "bpe"))
    proc = launch_pretrain(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                         "--seq-length", str(POSITIONS), "--max-position-embeddings", str(POSITIONS),
                         "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--mock-data",
                         "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", bpe["vocab_file"],
                         "--merge-file", bpe["merge_file"], "--eval-iters", "0", "--train-iters", "2",
                         "--save", str(root / "ck")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    convert = load_tool("convert_checkpoint").main
    assert convert(["reshard", "--load", str(root / "ck"), "--save", str(root / "tp2"),
                    "--tensor-model-parallel-size", "2"]) == 0
    out = str(root / "hf")
    assert convert(["to-hf", "--load", str(root / "tp2"), "--save", out]) == 0  # no tokenizer flags
    from megalite.data.tokenizer import GPT2BPETokenizer

    return {"dir": out, "eod": GPT2BPETokenizer(bpe["vocab_file"], bpe["merge_file"]).eod}


def _json(export: dict, name: str) -> dict:
    return json.load(open(os.path.join(export["dir"], name)))


def test_tokenizer_config_is_portable(export):
    conf = _json(export, "tokenizer_config.json")
    assert conf["tokenizer_class"] == "PreTrainedTokenizerFast" and "backend" not in conf
    assert conf["model_max_length"] == POSITIONS
    assert conf["eos_token"] == conf["bos_token"] == "<|endoftext|>"


def test_bos_and_eos_ids_are_set(export):
    for name in ("config.json", "generation_config.json"):
        conf = _json(export, name)
        assert conf["bos_token_id"] == conf["eos_token_id"] == export["eod"], name


def test_llama_export_writes_rope_theta_for_transformers_4():
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, position_embedding_type="rope",
                      rotary_base=500000, normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
                      max_position_embeddings=16)
    d = to_hf_config(config_dict(cfg, 300), eod=7).to_dict()
    assert d["rope_theta"] == 500000.0 and d["rope_parameters"]["rope_theta"] == 500000.0
    assert d["bos_token_id"] == d["eos_token_id"] == 7


def _probe(python: str, folder: str) -> dict:
    proc = subprocess.run([python, "-c", PROBE, folder, TEXT], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": "", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not OLD_PYTHON, reason="set MEGALITE_OLD_TRANSFORMERS_PYTHON to a Python with transformers 4.x")
def test_export_loads_with_transformers_4(export):
    import sys

    old, new = _probe(OLD_PYTHON, export["dir"]), _probe(sys.executable, export["dir"])
    assert old["version"].startswith("4."), old["version"]
    assert old["class"] == "PreTrainedTokenizerFast" and old["max"] == POSITIONS
    assert old["ids"] == new["ids"] and old["gen"] == [export["eod"]] * 2
    torch.testing.assert_close(torch.tensor(old["logits"]), torch.tensor(new["logits"]), rtol=0, atol=1e-5)
