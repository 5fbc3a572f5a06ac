"""Promises of the Hugging Face adapters (megalite/checkpointing/hf/adapter.py, registry.py, families/):
- no architecture name (an HF model_type, a transformers model or config class) is a string literal in
  megalite/ outside the adapter modules: the converter core branches on none;
- a new family is one adapter (here a Llama variant under another model_type, a subclass of the Llama
  adapter) and one registry entry: a tiny transformers model of it goes through from-hf (the command) to
  megalite with transformers' logits, and back to an HF folder of that family with identical tensors;
- export picks the adapter by the megalite config, and an asked-for family that does not fit is named.
Models are built from configs; nothing is downloaded."""

from __future__ import annotations

import ast
import json
import os
import re

import pytest
import torch

from megalite.checkpointing.full_reader import FullCheckpoint
from megalite.checkpointing.hf import registry
from megalite.checkpointing.hf.convert import (
    HFConversionError,
    architecture,
    from_hf_config,
    from_hf_state_dict,
    save_hf_model,
    to_hf_config,
    to_hf_state_dict,
)
from megalite.checkpointing.hf.families.llama import Llama
from megalite.checkpointing.metadata import model_config
from megalite.checkpointing.stored import checkpoint_key
from megalite.model.gpt import GPTModel
from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.random import RNGTracker
from tests.cli_utils import load_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES_DIR = os.path.join("megalite", "checkpointing", "hf", "families")
# the families the next issues bring, named before their adapters exist
COMING = {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3", "gemma3_text", "olmo2",
          "deepseek_v3"}
CLASS_NAME = re.compile(r"\w+(ForCausalLM|LMHeadModel)$")
VOCAB, SEQ = 128, 12  # a multiple of 128: the megalite model's logits are the true vocab's
TOKENS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(11))
convert = load_tool("convert_checkpoint").main


# ---- no architecture name outside the adapters -----------------------------------------------------------


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants (prose that documents, not code that branches)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def architecture_literals(root: str, model_types: set[str], classes: set[str]) -> list[str]:
    """``file:line: literal`` for every string literal under ``root``/megalite (outside the family modules, not
    a docstring) that is an HF model_type (``c.model_type == "llama"``, a dict key) or holds a transformers
    class name as a word (``classes``, or any ``...ForCausalLM`` / ``...LMHeadModel``, in a message too)."""
    found = []
    for folder, _, files in os.walk(os.path.join(root, "megalite")):
        rel_folder = os.path.relpath(folder, root)
        if rel_folder == FAMILIES_DIR or rel_folder.startswith(FAMILIES_DIR + os.sep):
            continue
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            tree = ast.parse(open(path).read(), path)
            docs = _docstrings(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                    words = set(re.findall(r"\w+", node.value))
                    if node.value in model_types or words & classes or any(CLASS_NAME.match(w) for w in words):
                        found.append(f"{os.path.relpath(path, root)}:{node.lineno}: {node.value!r}")
    return found


def architecture_names() -> tuple[set[str], set[str]]:
    """(model_types, class names): every registered adapter's, and the model_types of the families to come."""
    model_types = {n for a in registry.ADAPTERS for n in a.model_types} | COMING
    classes = {n for a in registry.ADAPTERS for n in (a.architecture, a.config_class_name)}
    return model_types, classes


def test_no_architecture_name_outside_the_adapters():
    model_types, classes = architecture_names()
    assert {"gpt2", "llama", "mixtral", "qwen2_moe"} <= model_types and {"LlamaForCausalLM", "GPT2Config"} <= classes
    found = architecture_literals(ROOT, model_types, classes)
    assert not found, "architecture names outside hf/families/ (move them into the adapter):\n" + "\n".join(found)


def test_the_scan_sees_a_planted_literal(tmp_path):
    """The scan is not vacuous: a branch on a model_type in the core, or a class name in a message, is found."""
    core = tmp_path / "megalite" / "checkpointing" / "hf"
    core.mkdir(parents=True)
    (core / "convert.py").write_text('"""the doc may say LlamaForCausalLM"""\n'
                                     'def f(c):\n    return c.model_type == "qwen3"\n'
                                     'MSG = f"needs {1} as Qwen2MoeForCausalLM does"\n'
                                     'CITED = "best_practice/mixtral/run.sh"\n')
    family = tmp_path / FAMILIES_DIR
    family.mkdir(parents=True)
    (family / "qwen3.py").write_text('MODEL_TYPE = "qwen3"\n')
    found = architecture_literals(str(tmp_path), *architecture_names())
    assert sorted(f.split(": ")[0] for f in found) == ["megalite/checkpointing/hf/convert.py:3",
                                                       "megalite/checkpointing/hf/convert.py:4"], found


# ---- a new family: one adapter, one registry entry ---------------------------------------------------------


def _llamalite_classes():
    """A Llama variant under another model_type, as a third-party transformers model would define it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    class LlamaLiteConfig(LlamaConfig):
        model_type = "llamalite"

    class LlamaLiteForCausalLM(LlamaForCausalLM):
        config_class = LlamaLiteConfig

    return LlamaLiteConfig, LlamaLiteForCausalLM


LiteConfig, LiteModel = _llamalite_classes()


class LlamaLite(Llama):
    """The whole family: its names; everything else is the Llama adapter's. (A family transformers ships
    needs no class hooks: the base class finds them by name.)"""

    model_type = "llamalite"
    architecture = "LlamaLiteForCausalLM"
    config_class_name = "LlamaLiteConfig"

    def config_class(self) -> type:
        return LiteConfig

    def model_class(self) -> type:
        return LiteModel


@pytest.fixture
def llamalite():
    adapter = LlamaLite()
    registry.register(adapter)  # the one registry entry
    yield adapter
    registry.unregister(adapter)


def lite_model():
    torch.manual_seed(0)
    model = LiteModel(LiteConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                 rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, rms_norm_eps=1e-5,
                                 tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                                 pad_token_id=None))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)  # norms too: no mapping error hides behind 1s
    return model.eval()


def test_a_new_family_round_trips_through_from_hf_and_to_hf(llamalite, tmp_path):
    hf = lite_model()
    folder, ckpt = str(tmp_path / "hf"), str(tmp_path / "ck")
    hf.save_pretrained(folder)
    assert json.load(open(os.path.join(folder, "config.json")))["model_type"] == "llamalite"
    with torch.no_grad():
        want = hf(TOKENS).logits

    # from-hf, the command: the registry finds the adapter by the folder's model_type
    assert convert(["from-hf", "--load", folder, "--save", ckpt]) == 0
    saved = FullCheckpoint(ckpt)
    full = {k: saved.param(k) for k in saved.keys()}
    config = from_hf_config(hf.config)
    assert full.keys() == from_hf_state_dict(config, hf.state_dict()).keys()
    cfg, vocab = model_config(config)
    model = GPTModel(cfg, BuildContext(ProcessGroups.single(), RNGTracker()), vocab).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(full[checkpoint_key(n, p)])
        got = model(TOKENS)
    assert got.shape == want.shape and want.std() > 0.05 and (got - want).abs().max().item() <= 1e-4

    # to-hf in the family asked for: the same tensors under the same model_type and class
    out = str(tmp_path / "back")
    back_config = to_hf_config(config, model_type="llamalite")
    save_hf_model(out, back_config, to_hf_state_dict(config, full.__getitem__, model_type="llamalite"))
    written = json.load(open(os.path.join(out, "config.json")))
    assert (written["model_type"], written["architectures"]) == ("llamalite", ["LlamaLiteForCausalLM"])
    again = LiteModel.from_pretrained(out, local_files_only=True)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in hf.state_dict().items())


def test_export_picks_the_family_by_the_megalite_config(llamalite):
    """Unasked, a Llama-style config exports as Llama (the first adapter that matches); a family asked for
    that the config does not fit is refused naming what it lacks."""
    config = from_hf_config(lite_model().config)
    cfg = model_config(config)[0]
    assert architecture(cfg) == "llama" and architecture(cfg, "llamalite") == "llamalite"
    assert to_hf_config(config).architectures == ["LlamaForCausalLM"]
    with pytest.raises(HFConversionError, match=r"MixtralForCausalLM needs .*\(missing: [^;]*--num-experts"):
        architecture(cfg, "mixtral")
    with pytest.raises(HFConversionError, match="export: unsupported architecture .model_type 'nope'"):
        architecture(cfg, "nope")


def test_a_model_type_has_one_adapter(llamalite):
    with pytest.raises(ValueError, match="model_type 'llamalite' already has an adapter"):
        registry.register(LlamaLite())
