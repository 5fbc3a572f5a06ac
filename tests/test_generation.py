"""Promises of generation (megalite/inference/generation.py, tools/generate.py):
- the KV cache changes nothing: cached decoding gives the same logits (<= 1e-5) and the same tokens as
  recomputing the whole sequence, greedy and sampled, GPT-2 and Llama/GQA models;
- prompts of different lengths batched together give what each prompt gives alone; a stop token ends
  only its own sequence;
- sampling is temperature -> top-k -> top-p as transformers' warpers, and a seed fixes the samples;
- greedy generations from a checkpoint equal transformers' generate(do_sample=False) on its to-hf export;
- at TP=2 PP=2 (and PP=2 with virtual stages, TP=2 x DP=2) the tool gives the single-process tokens
  (under NCCL's point-to-point rules);
- the tool prints a sample using the tokenizer the checkpoint names; impossible lengths are refused.
Models are built from configs; nothing is downloaded."""

from __future__ import annotations

import json
import os

import pytest
import torch

from megalite.checkpointing.metadata import config_dict
from megalite.checkpointing.paths import iter_dirname
from megalite.checkpointing.stored import named_params
from megalite.checkpointing.writer import write_checkpoint
from megalite.config.model import ModelConfig
from megalite.inference.generation import GenerationError, generate
from megalite.inference.kv_cache import KVCache
from megalite.inference.sampling import SamplingParams, filter_logits, sample
from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.param_meta import param_meta
from tests.cli_utils import load_tool
from tests.harness import run_ranks
from tests.tp_utils import GPT2, LLAMA_GQA, build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {
    "gpt2": {**GPT2, "num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 32,
             "max_position_embeddings": 64},
    "llama_gqa": {**LLAMA_GQA, "num_layers": 4, "hidden_size": 64, "num_attention_heads": 8, "num_query_groups": 2,
                  "seq_length": 32, "max_position_embeddings": 64},
}
VOCAB = 300
PROMPTS = [[5, 17, 2, 99, 43], [250, 8, 8, 31, 7, 77, 120, 3, 64], [11, 200, 9]]
SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95)
TEXT = ("def parse(line):\n    return line.split()\n\nclass Reader:\n    \"\"\"Read the lines of a file.\"\"\"\n"
        "    def __init__(self, path):\n        self.path = path\n") * 30


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: extra threads only spin (and crawl when the 2 cores are shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def perturbed_model(flags: dict, vocab: int = VOCAB, seed: int = 0):
    """A single-process model with random values everywhere (norms and biases too) and peaked outputs,
    so greedy choices are far from ties."""
    model = build(ModelConfig(**flags), ProcessGroups.single(), vocab)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def write_test_checkpoint(path: str, flags: dict, tp: int, pp: int, vocab: int = VOCAB, seed: int = 0,
                          tokenizer: dict | None = None, edit=None) -> str:
    """A checkpoint at layout (tp, pp) of ``perturbed_model`` (recording ``tokenizer`` as training does;
    ``edit(model)`` may change the weights first)."""
    model = perturbed_model(flags, vocab, seed)
    if edit is not None:
        with torch.no_grad():
            edit(model)
    full = {key: param_meta(p).spec.unshard([p.detach()]) for _, key, p in named_params([model])}
    write_checkpoint(path, config_dict(ModelConfig(**flags), vocab), full.__getitem__, tp=tp, pp=pp, iteration=5)
    if tokenizer is not None:
        meta_path = os.path.join(path, iter_dirname(5), "metadata.json")
        meta = json.load(open(meta_path))
        meta["tokenizer"] = {"tokenizer_type": "GPT2BPETokenizer", "vocab_size": None, "tokenizer_model": None,
                             **{k: tokenizer[k] for k in ("vocab_file", "merge_file")}}
        json.dump(meta, open(meta_path, "w"))
    return path


def bpe_files(root: str) -> dict:
    from megalite.data.tokenizer import GPT2BPETokenizer
    from megalite.data.tokenizer_training import train_bpe

    files = train_bpe([TEXT], VOCAB, os.path.join(root, "bpe"))
    tok = GPT2BPETokenizer(files["vocab_file"], files["merge_file"])
    return {**files, "vocab_size": tok.vocab_size, "eod": tok.eod}


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("gen"))
    bpe = bpe_files(root)
    ckpts = {name: write_test_checkpoint(os.path.join(root, name), flags, 2, 2, vocab=bpe["vocab_size"],
                                         tokenizer=bpe) for name, flags in MODELS.items()}
    return {"root": root, "bpe": bpe, "ckpts": ckpts}


# ---- the cache --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_cached_decoding_gives_the_full_forward_logits(name):
    model = perturbed_model(MODELS[name])
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(tokens)
        cache = KVCache(12)
        got = []
        for lo, hi in ((0, 5), (5, 6), (6, 9), (9, 10), (10, 12)):  # prefill, single tokens and chunks
            got.append(model(tokens[:, lo:hi], kv_cache=cache))
            cache.advance(hi - lo)
    got = torch.cat(got, dim=1)
    assert want.std() > 0.5, "logits too flat for the comparison to mean anything"
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", MODELS)
def test_kv_cache_gives_the_same_tokens_greedy_and_sampled(name):
    model = perturbed_model(MODELS[name])
    pg = ProcessGroups.single()
    for params in (SamplingParams(greedy=True), SAMPLED):
        cached = generate([model], pg, PROMPTS, 12, params, seed=3, use_cache=True)
        full = generate([model], pg, PROMPTS, 12, params, seed=3, use_cache=False)
        assert cached.tokens == full.tokens, params
        assert [len(t) for t in cached.new_tokens] == [12, 12, 12]
        assert [t[: len(p)] for t, p in zip(cached.tokens, PROMPTS)] == PROMPTS


def test_batched_prompts_equal_each_prompt_alone():
    model = perturbed_model(MODELS["llama_gqa"])
    pg = ProcessGroups.single()
    batched = generate([model], pg, PROMPTS, 10)
    assert batched.tokens == [generate([model], pg, [p], 10).tokens[0] for p in PROMPTS]


def test_a_stop_token_ends_only_its_sequence():
    model = perturbed_model(MODELS["gpt2"])
    pg = ProcessGroups.single()
    free = generate([model], pg, PROMPTS, 10).new_tokens
    stop = free[0][3]
    got = generate([model], pg, PROMPTS, 10, stop_token=stop).new_tokens
    for new, old in zip(got, free):
        end = old.index(stop) + 1 if stop in old else len(old)
        assert new == old[:end]
    assert got[0][-1] == stop and len(got[0]) <= 4


def test_a_seed_fixes_the_samples():
    model = perturbed_model(MODELS["gpt2"])
    pg = ProcessGroups.single()
    runs = [generate([model], pg, PROMPTS, 16, SamplingParams(temperature=1.5), seed=s).tokens for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


# ---- sampling rules ----------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 5, 0.0), (0.7, 0, 0.9), (1.3, 20, 0.5), (1.0, 0, 0.3),
                                                      (0.5, 3, 0.99)])
def test_filters_equal_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(6, 200, generator=torch.Generator().manual_seed(top_k)) * 3
    want = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        want = TopKLogitsWarper(top_k)(None, want)
    if top_p:
        want = TopPLogitsWarper(top_p)(None, want)
    got = filter_logits(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert torch.allclose(got[torch.isfinite(got)], want[torch.isfinite(want)])
    kept = torch.isfinite(got)
    draws = torch.stack([sample(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p),
                                torch.Generator().manual_seed(i)) for i in range(20)], dim=1)
    assert kept.gather(1, draws).all(), "a filtered-out token was drawn"


def test_greedy_is_argmax_and_bad_parameters_are_named():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    for p in (SamplingParams(greedy=True), SamplingParams(temperature=0.0), SamplingParams(top_k=1)):
        assert torch.equal(sample(logits, p, None), logits.argmax(-1))
    with pytest.raises(ValueError, match=r"--top-p must be in \[0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="--temperature must be >= 0"):
        SamplingParams(temperature=-1.0)


def test_lengths_past_the_position_table_are_refused():
    model = perturbed_model(MODELS["gpt2"])
    with pytest.raises(GenerationError, match=r"prompt \(9 tokens\) \+ 60 new tokens = 69 positions exceed the "
                                              r"model's --max-position-embeddings \(64\)"):
        generate([model], ProcessGroups.single(), PROMPTS, 60)


# ---- against transformers, and the tool ------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_equal_transformers_generate_on_the_to_hf_export(env, tmp_path, name):
    import transformers

    hf_dir = str(tmp_path / "hf")
    assert load_tool("convert_checkpoint").main(["to-hf", "--load", env["ckpts"][name], "--save", hf_dir]) == 0
    cls = "GPT2LMHeadModel" if name == "gpt2" else "LlamaForCausalLM"
    hf = getattr(transformers, cls).from_pretrained(hf_dir, local_files_only=True).eval()
    out = str(tmp_path / "gen.json")
    argv = ["--load", env["ckpts"][name], "--greedy", "--ignore-eod", "--max-new-tokens", "24", "--output-json", out,
            "--prompt", "def parse(line):\n", "--prompt", "class Reader:\n    \"\"\"Read"]
    assert load_tool("generate").main(argv) == 0
    ours = json.load(open(out))
    for row in ours:
        ids = torch.tensor([row["prompt_tokens"]])
        with torch.no_grad():
            theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                                 min_new_tokens=24, eos_token_id=None, pad_token_id=0)
        assert row["tokens"] == theirs[0].tolist(), name


def test_tool_prints_a_sample_with_the_checkpoints_tokenizer(env, capsys):
    argv = ["--load", env["ckpts"]["gpt2"], "--prompt", "def parse(", "--max-new-tokens", "8", "--top-k", "5",
            "--seed", "11"]
    assert load_tool("generate").main(argv) == 0
    out = capsys.readouterr().out
    assert "----- prompt 1 (" in out and "top-k 5, seed 11) -----\ndef parse(" in out
    assert "tokens/s, KV cache on, TP=1 PP=1)" in out
    assert load_tool("generate").main(argv[:2]) == 2
    assert "give --prompt TEXT" in capsys.readouterr().err


# ---- layouts -----------------------------------------------------------------------------------------------

LAYOUTS = {"tp2_pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
           "pp2_vp2_dp2": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
           "tp2_dp2": ["--tensor-model-parallel-size", "2"]}
RUNS = {"greedy": ["--greedy"], "sampled": ["--temperature", "0.9", "--top-p", "0.9", "--seed", "5"],
        "sampled_no_cache": ["--temperature", "0.9", "--top-p", "0.9", "--seed", "5", "--no-kv-cache"]}


def _generate_argv(ckpt: str, run: str) -> list[str]:
    return ["--load", ckpt, "--prompt", "def parse(line):\n", "--prompt", "class", "--max-new-tokens", "10",
            "--ignore-eod", *RUNS[run]]


PLAN = [("tp2_pp2", "greedy"), ("tp2_pp2", "sampled"), ("tp2_pp2", "sampled_no_cache"),
        ("pp2_vp2_dp2", "greedy"), ("tp2_dp2", "sampled")]


def _layout_ranks(rank: int, world: int, ckpt: str) -> dict:
    tool = load_tool("generate")
    quiet = lambda s: None  # noqa: E731
    return {(layout, run): tool.run(_generate_argv(ckpt, run) + LAYOUTS[layout], say=quiet).tokens
            for layout, run in PLAN}


def test_tp2_pp2_and_other_layouts_generate_the_single_process_tokens(env, nccl_semantics):
    ckpt = env["ckpts"]["llama_gqa"]
    tool = load_tool("generate")
    want = {run: tool.run(_generate_argv(ckpt, run), say=lambda s: None).tokens for run in RUNS}
    assert want["sampled"] == want["sampled_no_cache"] and want["sampled"] != want["greedy"]
    results = run_ranks(_layout_ranks, 4, ckpt, timeout=200)
    for rank, got in enumerate(results):
        for (layout, run), tokens in got.items():
            assert tokens == want[run], (rank, layout, run)
