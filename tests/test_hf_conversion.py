"""Promises of Hugging Face conversion (tools/convert_checkpoint.py to-hf / from-hf):
- a checkpoint saved at TP and PP > 1 (GQA with groups < TP, tied and untied embeddings, GPT-2 and Llama
  styles) exports to a transformers model whose logits equal the megalite model's (fp32, <= 1e-4);
- a transformers model imported at TP=2 PP=2 gives the same logits in megalite;
- HF -> megalite -> HF returns identical tensors (and tokenizer files);
- the QKV interleave is undone and rebuilt per KV group (docs/design.md §3.3).
Models are built from configs; nothing is downloaded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from megalite.checkpointing import load_checkpoint
from megalite.checkpointing.hf.convert import from_hf_state_dict, fuse_qkv, split_qkv, to_hf_state_dict
from megalite.checkpointing.metadata import config_dict, model_config
from megalite.checkpointing.reader import CheckpointReader
from megalite.checkpointing.stored import named_params
from megalite.config import validate
from megalite.config.arguments import MegaliteConfig
from megalite.model.build import build_model
from megalite.model.gpt import GPTModel
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.param_meta import param_meta
from megalite.tensor_parallel.random import RNGTracker, model_parallel_seed
from megalite.training.loop import pretrain
from tests.cli_utils import load_tool
from tests.harness import run_ranks
from tests.tp_utils import GPT2, LLAMA_GQA, groups_for, mock_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "convert_checkpoint.py")
VOCAB = 300  # not a multiple of 128 x TP: shards are padded, HF holds the true vocab
SEQ = 16
TOKENS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))
QUIET = lambda s: None  # noqa: E731

LLAMA = {**LLAMA_GQA, "num_layers": 4, "hidden_size": 64, "num_attention_heads": 8, "num_query_groups": 2}
GPT = {**GPT2, "num_layers": 4, "hidden_size": 32}
# Checkpoints trained and saved on 4 ranks: name -> (model flags, tp, pp, extra flags).
SAVED = {
    "llama_gqa_tp2_pp2_untied": (LLAMA, 2, 2, {}),
    "llama_gqa_groups_lt_tp4_tied_qkv_bias": (
        {**LLAMA, "untie_embeddings_and_output_weights": False, "add_qkv_bias": True}, 4, 1, {}),
    "gpt2_tp2_pp2_tied": (GPT, 2, 2, {}),
    "gpt2_tp2_dp2_untied_distopt": ({**GPT, "untie_embeddings_and_output_weights": True}, 2, 1,
                                    {"use_distributed_optimizer": True}),
}
IMPORTED = ("gpt2", "llama_gqa")  # HF models imported at TP=2 PP=2


convert = load_tool("convert_checkpoint").main


def make_cfg(model: dict, tp: int, pp: int, iters: int = 2, **extra) -> MegaliteConfig:
    return MegaliteConfig.from_flat(dict(
        model, seq_length=SEQ, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, micro_batch_size=1,
        global_batch_size=4, train_iters=iters, lr=3e-3, lr_warmup_iters=0, log_interval=5, eval_iters=0,
        eval_interval=1000, mock_data=True, vocab_size=VOCAB, seed=1234, **extra))


@torch.no_grad()
def pipeline_logits(chunks, tokens, pg) -> torch.Tensor | None:
    """Full logits [b, s, vocab] of the model as laid out (TP x PP), on TP rank 0 of DP rank 0 of the last
    stage; None elsewhere. Hidden states travel stage to stage with plain send/recv."""
    model = chunks[0]
    model.eval()
    b, s = tokens.shape
    if pg.is_first_stage:
        out = model(tokens)
    else:
        x = torch.empty(s, b, model.cfg.hidden_size)
        dist.recv(x, src=pg.ranks["pp"][pg.pp_rank - 1])
        out = model(hidden=x)
    if not pg.is_last_stage:
        dist.send(out.contiguous(), dst=pg.ranks["pp"][pg.pp_rank + 1])
        return None
    return out if pg.tp_rank == 0 and pg.dp_rank == 0 else None


def _ranks(rank: int, world: int, root: str, tokens: torch.Tensor) -> dict:
    out = {}
    data = mock_data(VOCAB, SEQ, 1234, 64)
    for name, (model, tp, pp, extra) in SAVED.items():
        cfg = make_cfg(model, tp, pp, save=os.path.join(root, name), **extra)
        validate(cfg, world)
        res = pretrain(cfg, groups_for(world, rank, tp=tp, pp=pp), data=data, log=QUIET)
        out[name] = pipeline_logits(res.chunks, tokens, res.chunks[0].pg)
    for name in IMPORTED:  # written by from-hf at TP=2 PP=2 before the ranks started
        path = os.path.join(root, f"imported_{name}")
        saved = CheckpointReader(path).config
        mcfg, vocab = model_config(saved)
        cfg = make_cfg({k: v for k, v in saved.items() if k in vars(mcfg)}, 2, 2)
        pg = groups_for(world, rank, tp=2, pp=2)
        chunks = build_model(cfg, pg, vocab, model_parallel_seed(1, pg.tp_rank, pg.pp_rank))
        load_checkpoint(path, chunks, None, pg, saved, load_optim=False, load_rng=False)
        out[f"imported_{name}"] = pipeline_logits(chunks, tokens, pg)
    return out


def _perturbed(model):
    """Random values everywhere (norm weights and biases too), so no mapping error can hide behind 1s and 0s."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def hf_models(eod: int) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return {
        "gpt2": GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                                           activation_function="gelu", bos_token_id=eod, eos_token_id=eod)),
        "llama_gqa": LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=SEQ, rope_parameters={"rope_type": "default",
                                                                                 "rope_theta": 5000.0},
            rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)),
    }


def hf_tokenizer(path: str) -> dict:
    """A small byte-level BPE (its files, and its transformers tokenizer folder at ``path``)."""
    from transformers import PreTrainedTokenizerFast

    from megalite.data.tokenizer import GPT2BPETokenizer
    from megalite.data.tokenizer_training import train_bpe

    files = train_bpe(["the cat sat on the mat, and the dog sat on the log. " * 20], VOCAB, path + "_bpe")
    tok = GPT2BPETokenizer(files["vocab_file"], files["merge_file"])
    PreTrainedTokenizerFast(tokenizer_object=tok._tok, eos_token="<|endoftext|>").save_pretrained(path)
    return {**files, "eod": tok.eod}


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("hf"))
    models = {}
    bpe = hf_tokenizer(os.path.join(root, "hf_gpt2"))  # the GPT-2 folder holds a tokenizer too
    for name, model in hf_models(bpe["eod"]).items():
        models[name] = _perturbed(model)
        folder = os.path.join(root, f"hf_{name}")
        model.save_pretrained(folder)
        assert convert(["from-hf", "--load", folder, "--save", os.path.join(root, f"imported_{name}"),
                        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]) == 0
    results = run_ranks(_ranks, 4, root, TOKENS, timeout=300)
    logits = {k: next(r[k] for r in results if r[k] is not None) for k in results[0]}
    return {"root": root, "logits": logits, "hf_models": models, "bpe": bpe}


def hf_logits(folder: str, cls_name: str) -> torch.Tensor:
    import transformers

    model = getattr(transformers, cls_name).from_pretrained(folder, local_files_only=True).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape == (*TOKENS.shape, VOCAB), what
    assert want.std() > 0.05, f"{what}: logits too flat for the comparison to mean anything"
    diff = (got - want).abs().max().item()
    assert diff <= 1e-4, f"{what}: max abs logit diff {diff:.3e}"


# ---- megalite -> HF --------------------------------------------------------------------------------


def test_to_hf_command_llama_gqa_tp2_pp2_loads_and_logits_match(env, tmp_path):
    """The issue's acceptance command, run as a user would."""
    out = str(tmp_path / "llama_hf")
    ckpt = os.path.join(env["root"], "llama_gqa_tp2_pp2_untied")
    proc = subprocess.run([sys.executable, TOOL, "to-hf", "--load", ckpt, "--save", out], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    assert not config["tie_word_embeddings"]
    _assert_close(hf_logits(out, "LlamaForCausalLM"), env["logits"]["llama_gqa_tp2_pp2_untied"], "llama tp2 pp2")


@pytest.mark.parametrize("name", [n for n in SAVED if n != "llama_gqa_tp2_pp2_untied"])
def test_to_hf_logits_match_the_saved_layout(env, tmp_path, name):
    out = str(tmp_path / name)
    assert convert(["to-hf", "--load", os.path.join(env["root"], name), "--save", out]) == 0
    config = json.load(open(os.path.join(out, "config.json")))
    tied = not SAVED[name][0].get("untie_embeddings_and_output_weights", False)
    assert config["tie_word_embeddings"] == tied
    assert ("lm_head.weight" in load_file(os.path.join(out, "model.safetensors"))) == (not tied)
    cls = config["architectures"][0]
    assert cls == ("GPT2LMHeadModel" if name.startswith("gpt2") else "Qwen2ForCausalLM" if "qkv_bias" in name
                   else "LlamaForCausalLM")  # biases on q/k/v only: Qwen2's architecture
    _assert_close(hf_logits(out, cls), env["logits"][name], name)


def test_to_hf_exports_the_runs_tokenizer(env, tmp_path):
    from transformers import AutoTokenizer

    from megalite.data.tokenizer import GPT2BPETokenizer

    out, bpe = str(tmp_path / "with_tok"), env["bpe"]
    assert convert(["to-hf", "--load", os.path.join(env["root"], "gpt2_tp2_pp2_tied"), "--save", out,
                    "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", bpe["vocab_file"],
                    "--merge-file", bpe["merge_file"]]) == 0
    ours = GPT2BPETokenizer(bpe["vocab_file"], bpe["merge_file"])
    theirs = AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = "the dog sat on the cat<|endoftext|> mat"
    assert theirs.encode(text, add_special_tokens=False) == ours.tokenize(text)
    assert json.load(open(os.path.join(out, "config.json")))["eos_token_id"] == ours.eod


# ---- HF -> megalite -> HF ------------------------------------------------------------------------


@pytest.mark.parametrize("name", IMPORTED)
def test_from_hf_at_tp2_pp2_gives_the_hf_logits(env, name):
    with torch.no_grad():
        want = env["hf_models"][name](TOKENS).logits
    _assert_close(env["logits"][f"imported_{name}"], want, f"imported {name}")


@pytest.mark.parametrize("name", IMPORTED)
def test_round_trip_hf_megalite_hf_is_identical(env, tmp_path, name):
    src, out = os.path.join(env["root"], f"hf_{name}"), str(tmp_path / name)
    assert convert(["to-hf", "--load", os.path.join(env["root"], f"imported_{name}"), "--save", out]) == 0
    a, b = load_file(os.path.join(src, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    ca, cb = (json.load(open(os.path.join(d, "config.json"))) for d in (src, out))
    skip = {"transformers_version", "dtype", "torch_dtype", "_name_or_path", "use_cache", "rope_theta"}
    assert {k: v for k, v in ca.items() if k not in skip} == {k: v for k, v in cb.items() if k not in skip}
    if name == "gpt2":  # from-hf kept the tokenizer files, to-hf exported them again
        from transformers import AutoTokenizer

        t_src, t_out = (AutoTokenizer.from_pretrained(d, local_files_only=True) for d in (src, out))
        assert t_src.get_vocab() == t_out.get_vocab() and t_out.eos_token == "<|endoftext|>"


# ---- the interleave and errors -------------------------------------------------------------------


def test_qkv_interleave_is_per_group_queries_then_key_then_value():
    heads, groups, d = 8, 2, 3
    q = torch.arange(heads).repeat_interleave(d).float()  # row value = query head number
    k = 100 + torch.arange(groups).repeat_interleave(d).float()
    v = 200 + torch.arange(groups).repeat_interleave(d).float()
    fused = fuse_qkv(q[:, None], k[:, None], v[:, None], heads, groups, d)[:, 0]
    head_of_row = fused[::d].tolist()
    assert head_of_row == [0, 1, 2, 3, 100, 200, 4, 5, 6, 7, 101, 201]
    assert all(torch.equal(a, b[:, None]) for a, b in zip(split_qkv(fused[:, None], heads, groups, d), (q, k, v)))


@pytest.mark.parametrize("model,bias", [("gpt2", "none"), ("gpt2", "all"), ("llama", "none"), ("llama", "qkv"),
                                        ("llama", "all")])
def test_name_table_round_trips_every_tensor(model, bias):
    """to-hf then from-hf through the one name table gives back every megalite tensor, for bias styles
    the trained checkpoints above do not cover; biases megalite lacks are exported as zeros (q/k/v biases
    only: exported as Llama by name, whose o_proj then has zero biases; Qwen2 is their default)."""
    flags = {**(GPT if model == "gpt2" else LLAMA), "disable_bias_linear": bias != "all",
             "add_qkv_bias": bias == "qkv"}
    cfg = make_cfg(flags, 1, 1).model
    conf = config_dict(cfg, VOCAB)
    meta = GPTModel(cfg, BuildContext(groups_for(1, 0), RNGTracker(), device=torch.device("meta")), VOCAB)
    g = torch.Generator().manual_seed(0)
    full = {k: torch.randn(param_meta(p).full_shape, generator=g) for n, k, p in named_params([meta])
            if n == k}
    model_type = "llama" if model == "llama" else None
    hf = to_hf_state_dict(conf, full.__getitem__, model_type=model_type)
    back = from_hf_state_dict(conf, hf, model_type=model_type)
    assert back.keys() == full.keys()
    assert all(torch.equal(back[k], full[k]) for k in full)
    zero_biases = sorted(k for k, t in hf.items() if k.endswith("bias") and not t.any())
    assert bool(zero_biases) == (bias == "none" and model == "gpt2" or bias == "qkv"), zero_biases


def test_unsupported_hf_architecture_is_named(tmp_path, capsys):
    from transformers import BertConfig

    BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
               intermediate_size=64).save_pretrained(str(tmp_path / "bert"))
    assert convert(["from-hf", "--load", str(tmp_path / "bert"), "--save", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert "config.json: unsupported architecture (model_type 'bert'" in err and "LlamaForCausalLM" in err
    assert not os.path.exists(tmp_path / "ck")


def test_from_hf_rejects_bad_input_before_reading_weights(env, tmp_path, capsys):
    folder = os.path.join(env["root"], "hf_llama_gqa")
    assert convert(["from-hf", "--load", folder, "--save", str(tmp_path / "ck"),
                    "--tensor-model-parallel-size", "3"]) == 2
    assert "--tensor-model-parallel-size (3) must divide --num-attention-heads (8)" in capsys.readouterr().err
    assert convert(["from-hf", "--load", str(tmp_path), "--save", str(tmp_path / "ck")]) == 2
    assert f"--load {tmp_path}: no config.json there" in capsys.readouterr().err
    scaled = tmp_path / "scaled"
    scaled.mkdir()
    config = json.load(open(os.path.join(folder, "config.json")))
    config["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}
    json.dump(config, open(scaled / "config.json", "w"))
    assert convert(["from-hf", "--load", str(scaled), "--save", str(tmp_path / "ck")]) == 2
    assert "rope_type 'linear' (RoPE scaling) is not supported" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "ck")


# ---- the weight files checked before anything is built (checkpointing/hf/files.py) -------------------------


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory) -> dict:
    """hf_models() saved as transformers folders (no ranks run): the inputs the import checks change."""
    root = tmp_path_factory.mktemp("hf_checks")
    for name, model in hf_models(eod=0).items():
        model.save_pretrained(str(root / name))
    return {name: str(root / name) for name in ("gpt2", "llama_gqa")}


def _variant(src: str, dst, config: dict | None = None, drop: str | None = None, size: int | None = None) -> str:
    """A copy of ``src`` with config.json keys changed, a tensor left out, or model.safetensors cut to ``size``."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    weights = os.path.join(dst, "model.safetensors")
    if config:
        path = os.path.join(dst, "config.json")
        json.dump({**json.load(open(path)), **config}, open(path, "w"))
    if drop:
        sd = load_file(weights)
        del sd[drop]
        save_file(sd, weights, metadata={"format": "pt"})
    if size is not None:
        os.truncate(weights, size if size >= 0 else os.path.getsize(weights) + size)
    return str(dst)


def _refused(folder: str, tmp_path, capsys) -> str:
    """from-hf exits 2 with one error line and no traceback, creating nothing."""
    out = tmp_path / "ck"
    assert convert(["from-hf", "--load", folder, "--save", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("convert_checkpoint.py from-hf: error: "), err
    assert not out.exists() and not os.path.exists(str(out) + ".incomplete")
    return err


@pytest.mark.parametrize("name, config, expected", [
    ("llama_gqa", {"num_hidden_layers": 1}, "tensor model.layers.1.input_layernorm.weight (and 8 more) has no place "
                                            "in the model"),
    ("gpt2", {"n_layer": 1}, "tensor transformer.h.1.attn.c_attn.bias (and 11 more) has no place in the model"),
    ("llama_gqa", {"intermediate_size": 128}, "tensor model.layers.0.mlp.down_proj.weight has shape [64, 96], but "
                                              "{folder}/config.json makes it [64, 128]: the config's sizes contradict"),
    ("gpt2", {"n_embd": 64}, "tensor transformer.h.0.attn.c_attn.bias has shape [96], but {folder}/config.json makes "
                             "it [192]"),
    ("llama_gqa", {"num_hidden_layers": 4}, "the weights have no tensor model.layers.2.self_attn.q_proj.weight, which "
                                            "the model {folder}/config.json describes has (and 17 more)"),
])
def test_from_hf_refuses_a_config_that_contradicts_its_weights(hf_folders, tmp_path, capsys, name, config, expected):
    """Fewer layers declared than stored: refused naming the first unused tensor (transformers' from_pretrained
    dropped them with a warning); sizes that contradict the weights: the tensor, both shapes; more layers
    declared: the first missing tensor (from_pretrained initialised it at random)."""
    folder = _variant(hf_folders[name], tmp_path / "hf", config=config)
    assert expected.format(folder=folder) in _refused(folder, tmp_path, capsys)


def test_from_hf_refuses_a_missing_tensor(hf_folders, tmp_path, capsys):
    folder = _variant(hf_folders["llama_gqa"], tmp_path / "hf", drop="model.layers.1.post_attention_layernorm.weight")
    assert "the weights have no tensor model.layers.1.post_attention_layernorm.weight," in _refused(
        folder, tmp_path, capsys)


@pytest.mark.parametrize("size, expected", [
    (-100, "tensor {last}: data offsets [{b}, {e}] run past the end of the data ({data} bytes)"),
    (60, "the header length {n} runs past the end of the file (60 bytes)"),
    (5, "5 bytes, shorter than the 8-byte header length"),
])
def test_from_hf_refuses_a_truncated_safetensors_file_from_its_header(hf_folders, tmp_path, capsys, size, expected):
    src = os.path.join(hf_folders["llama_gqa"], "model.safetensors")
    with open(src, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    (b, e), data = header[last]["data_offsets"], os.path.getsize(src) - 8 - n - 100
    folder = _variant(hf_folders["llama_gqa"], tmp_path / "hf", size=size)
    err = _refused(folder, tmp_path, capsys)
    assert f"{folder}/model.safetensors: truncated or not a safetensors file: " in err
    assert expected.format(n=n, last=last, b=b, e=e, data=data) in err, err


def test_stored_names_transformers_accepts_are_consumed():
    """The original GPT-2 files' keys have no 'transformer.' prefix and hold the causal-mask buffers; a tied
    model's stored lm_head.weight is the embedding: all consumed, nothing refused."""
    from megalite.checkpointing.hf.files import Stored, matched_weights

    shapes = {"transformer.wte.weight": (8, 4), "transformer.h.0.ln_1.weight": (4,), "lm_head.weight": (8, 4)}
    stored = {n: Stored("f", s, lambda s=s: torch.zeros(s)) for n, s in
              [("wte.weight", (8, 4)), ("h.0.ln_1.weight", (4,)), ("h.0.attn.bias", (1, 1, 4, 4)),
               ("h.0.attn.masked_bias", ()), ("lm_head.weight", (8, 4))]}
    assert set(matched_weights(stored, shapes, "transformer", True, "config.json")) == set(shapes)
    del stored["lm_head.weight"]
    assert set(matched_weights(stored, shapes, "transformer", True, "config.json")) == set(shapes) - {"lm_head.weight"}


def test_a_pytorch_model_bin_is_read_and_checked_as_safetensors_are(hf_folders, tmp_path):
    from megalite.checkpointing.hf.convert import HFConversionError, read_hf_config, read_hf_weights

    folder = _variant(hf_folders["llama_gqa"], tmp_path / "hf")
    want = load_file(os.path.join(folder, "model.safetensors"))
    os.remove(os.path.join(folder, "model.safetensors"))
    torch.save(want, os.path.join(folder, "pytorch_model.bin"))
    got = read_hf_weights(folder, read_hf_config(folder))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    os.truncate(os.path.join(folder, "pytorch_model.bin"), 1000)
    with pytest.raises(HFConversionError, match="pytorch_model.bin: not a readable PyTorch state dict"):
        read_hf_weights(folder, read_hf_config(folder))
