"""Proving a Hugging Face family against transformers' own class, written once for every family test.

A family test describes a tiny transformers model (``Family``: its class and config), and a module-scoped
fixture calls ``prepare(family, root)``: the model is built, every parameter perturbed (norms and biases
too, so no mapping error hides behind 1s and 0s), saved with ``save_pretrained`` and imported with
``tools/convert_checkpoint.py from-hf``, whose printed "Continue pretraining with" flags the runs use as a
user would. The checks then hold:

- ``assert_imported_logits``: megalite's forward of the imported checkpoint equals transformers' (fp32);
- ``assert_finetune_equals_hf``: ``pretrain_gpt.py --load … --finetune`` (8 iterations, constant LR, no
  warm-up, no clipping, dropout off, fp32, mock data) logs the losses of transformers' model trained with
  ``torch.optim.AdamW`` (the same betas, eps, weight decay on matrices only, as Megatron groups them) on the
  same samples, read through megalite's own dataset and sampler code;
- ``assert_layouts_equal_serial``: the same finetune at other layouts (TP2 + SP, PP2; CP2 / EP2 where a
  family asks) logs the serial curve, on plain gloo and under MEGALITE_NCCL_SEMANTICS=1;
- ``assert_exported_logits``: ``to-hf`` of the trained checkpoint loads in transformers with megalite's logits;
- ``assert_generation_equals_hf``: ``tools/generate.py --greedy`` gives transformers' ``generate`` tokens.

Mock data uses the NullTokenizer: ``--vocab-size V-1`` makes its vocabulary (ids and EOD) exactly the HF
model's V ids.
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.cli_utils import assert_same_log_curves, launch_pretrain, load_tool, losses

ITERS = 8
LR = 1e-3
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
SEED = 1234
MBS, GBS = 2, 4  # two micro-batches per step, so PP2 has a pipeline to run
TOL = 1e-5

convert = load_tool("convert_checkpoint").main


@dataclass(frozen=True)
class Family:
    """A tiny transformers model of one family."""

    name: str
    hf_class: str  # e.g. "LlamaForCausalLM"
    config: Callable[[], Any]  # a transformers config with tiny dims, dropout off, bos/eos None
    seq_length: int = 32  # training sequence length (may exceed the config's original context)
    extra_flags: tuple[str, ...] = ()  # flags the runs add to from-hf's printed ones

    @property
    def vocab(self) -> int:
        return self.config().vocab_size


@dataclass
class Prepared:
    """A family saved by transformers and imported by from-hf."""

    family: Family
    root: str
    hf_folder: str
    imported: str  # the from-hf checkpoint
    model_flags: list[str]  # from-hf's printed flags (without --load / --finetune)
    hf_model: Any  # the perturbed transformers model (eval mode, the saved weights)
    runs: dict[str, Any] = field(default_factory=dict)  # cached run logs


def perturbed(model: Any, seed: int = 3) -> Any:
    """Random values added everywhere (norm weights and biases too)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


def build_hf(family: Family) -> Any:
    import transformers

    torch.manual_seed(0)
    return perturbed(getattr(transformers, family.hf_class)(family.config()))


def from_hf(folder: str, save: str, *extra: str) -> list[str]:
    """Run from-hf; the model flags it prints for continued pretraining."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = convert(["from-hf", "--load", folder, "--save", save, *extra])
    assert code == 0, f"from-hf failed ({code}):\n{out.getvalue()[-3000:]}"
    text = out.getvalue()
    assert "Continue pretraining with:" in text, text
    flags = shlex.split(text.split("Continue pretraining with:", 1)[1].strip().splitlines()[0])
    load = flags.index("--load")
    del flags[load:load + 2]
    flags.remove("--finetune")
    return flags


def prepare(family: Family, root: str) -> Prepared:
    """Build, perturb, save_pretrained, import with from-hf (in ``root``)."""
    model = build_hf(family)
    folder = os.path.join(root, f"hf_{family.name}")
    model.save_pretrained(folder)
    imported = os.path.join(root, f"imported_{family.name}")
    return Prepared(family, root, folder, imported, from_hf(folder, imported), model)


def sample_tokens(family: Family, batch: int = 2, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, family.vocab, (batch, family.seq_length), generator=torch.Generator().manual_seed(seed))


# ---- megalite's side ----------------------------------------------------------------------------------


@torch.no_grad()
def megalite_logits(checkpoint: str, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [b, s, vocab] of a megalite checkpoint's newest iteration, in this process (one rank)."""
    from megalite.checkpointing import load_checkpoint
    from megalite.checkpointing.metadata import model_config
    from megalite.checkpointing.reader import CheckpointReader
    from megalite.config.arguments import MegaliteConfig
    from megalite.model.build import build_model
    from megalite.parallel.groups import ProcessGroups
    from megalite.tensor_parallel.random import model_parallel_seed

    saved = CheckpointReader(checkpoint).config
    mcfg, vocab = model_config(saved)
    flat = {k: v for k, v in saved.items() if k in vars(mcfg)}
    flat.update(seq_length=max(tokens.shape[1], mcfg.seq_length), vocab_size=vocab, mock_data=True)
    cfg = MegaliteConfig.from_flat(flat)
    pg = ProcessGroups.single()
    chunks = build_model(cfg, pg, vocab, model_parallel_seed(1, 0, 0))
    load_checkpoint(checkpoint, chunks, None, pg, saved, load_optim=False, load_rng=False)
    chunks[0].eval()
    return chunks[0](tokens)[..., :vocab]


def finetune_args(p: Prepared, save: str | None = None, iters: int = ITERS) -> list[str]:
    """pretrain_gpt.py flags of the family's finetune (serial; a layout adds its own flags)."""
    f = p.family
    args = ["--load", p.imported, "--finetune", *p.model_flags, *f.extra_flags,
            "--seq-length", str(f.seq_length), "--micro-batch-size", str(MBS), "--global-batch-size", str(GBS),
            "--train-iters", str(iters), "--lr", str(LR), "--min-lr", str(LR), "--lr-decay-style", "constant",
            "--lr-warmup-iters", "0", "--clip-grad", "0", "--weight-decay", str(WEIGHT_DECAY),
            "--adam-beta1", str(BETAS[0]), "--adam-beta2", str(BETAS[1]), "--adam-eps", str(EPS),
            "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(f.vocab - 1), "--seed", str(SEED), "--log-interval", "1", "--eval-iters", "0"]
    if save:
        args += ["--save", save, "--save-interval", str(iters)]
    return args


def serial_finetune(p: Prepared) -> dict[int, tuple[float, float | None]]:
    """The serial finetune's log (run once per Prepared), its checkpoint saved in ``trained``."""
    if "serial" not in p.runs:
        p.runs["serial"] = losses(launch_pretrain(finetune_args(p, save=trained(p))))
    return p.runs["serial"]


def trained(p: Prepared) -> str:
    return os.path.join(p.root, f"trained_{p.family.name}")


# ---- transformers' side -------------------------------------------------------------------------------


def hf_finetune_losses(p: Prepared, iters: int = ITERS) -> list[float]:
    """transformers' model (a fresh load of the saved folder) trained with torch AdamW on the samples
    megalite's mock dataset and sampler give the serial run, in its order: the loss of each iteration."""
    import torch.nn.functional as F
    import transformers

    from megalite.data.mock import MockGPTDataset
    from megalite.data.sampler import microbatch_indices

    f = p.family
    model = getattr(transformers, f.hf_class).from_pretrained(p.hf_folder, local_files_only=True)
    model.train()
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW([{"params": [q for q in params if q.ndim > 1], "weight_decay": WEIGHT_DECAY},
                             {"params": [q for q in params if q.ndim <= 1], "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS)
    data = MockGPTDataset(iters * GBS, f.seq_length, f.vocab, SEED)  # --seed is the train split's seed
    out = []
    for it in range(iters):
        idx = [i for mb in microbatch_indices(it * GBS, GBS, MBS, 0, 1) for i in mb]
        text = torch.from_numpy(torch.utils.data.default_collate([data[i]["text"] for i in idx]).numpy())
        logits = model(input_ids=text[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), text[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def hf_logits(folder: str, hf_class: str, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    model = getattr(transformers, hf_class).from_pretrained(folder, local_files_only=True).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


# ---- the checks ---------------------------------------------------------------------------------------


def assert_close_logits(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = TOL) -> None:
    assert got.shape == want.shape, f"{what}: shapes {tuple(got.shape)} vs {tuple(want.shape)}"
    assert want.std() > 0.05, f"{what}: logits too flat for the comparison to mean anything"
    diff = (got - want).abs().max().item()
    assert diff <= tol, f"{what}: max abs logit diff {diff:.3e} > {tol:g}"


def assert_imported_logits(p: Prepared) -> None:
    tokens = sample_tokens(p.family)
    with torch.no_grad():
        want = p.hf_model(input_ids=tokens).logits
    assert_close_logits(megalite_logits(p.imported, tokens), want, f"{p.family.name} from-hf")


def assert_finetune_equals_hf(p: Prepared) -> None:
    ours = serial_finetune(p)
    assert sorted(ours) == list(range(1, ITERS + 1)), f"logged iterations {sorted(ours)}"
    theirs = hf_finetune_losses(p)
    got = [ours[i][0] for i in range(1, ITERS + 1)]
    diffs = [abs(a - b) for a, b in zip(got, theirs)]
    assert max(diffs) <= TOL, (f"{p.family.name}: megalite {got}\n transformers {theirs}\n"
                               f" max diff {max(diffs):.3e} > {TOL:g}")
    assert theirs[-1] < theirs[0], f"{p.family.name}: the loss did not fall ({theirs})"


# layout name -> (ranks, flags)
LAYOUTS: dict[str, tuple[int, tuple[str, ...]]] = {
    "tp2_sp": (2, ("--tensor-model-parallel-size", "2", "--sequence-parallel")),
    "pp2": (2, ("--pipeline-model-parallel-size", "2")),
    "cp2_p2p": (2, ("--context-parallel-size", "2", "--cp-comm-type", "p2p")),
    "cp2_a2a": (2, ("--context-parallel-size", "2", "--cp-comm-type", "a2a")),
    "cp2_allgather": (2, ("--context-parallel-size", "2", "--cp-comm-type", "allgather")),
    "ep2": (2, ("--expert-model-parallel-size", "2")),
}


def assert_layout_equals_serial(p: Prepared, layout: str, nccl_semantics: bool = False) -> None:
    """The finetune at ``layout`` (a LAYOUTS key) logs the serial curve (lm loss and grad norm, rtol 1e-5)."""
    nproc, flags = LAYOUTS[layout]
    env = {"MEGALITE_NCCL_SEMANTICS": "1" if nccl_semantics else "0"}
    log = losses(launch_pretrain(finetune_args(p) + list(flags), nproc=nproc, env=env))
    what = f"{p.family.name} {layout}{' nccl-semantics' if nccl_semantics else ''}"
    assert_same_log_curves(log, serial_finetune(p), range(1, ITERS + 1), what, rtol=TOL)


def assert_layouts_equal_serial(p: Prepared, layouts: Sequence[str] = ("tp2_sp", "pp2"),
                                modes: Sequence[bool] = (False, True)) -> None:
    """Every layout in every point-to-point mode (plain gloo, MEGALITE_NCCL_SEMANTICS=1) gives the serial
    curve (tests usually parametrize over ``assert_layout_equals_serial`` instead, one case each)."""
    for layout in layouts:
        for nccl in modes:
            assert_layout_equals_serial(p, layout, nccl)


def assert_exported_logits(p: Prepared, out: str) -> None:
    """to-hf of the trained checkpoint: transformers' class loads it with megalite's logits."""
    serial_finetune(p)
    assert convert(["to-hf", "--load", trained(p), "--save", out]) == 0
    tokens = sample_tokens(p.family, seed=11)
    assert_close_logits(hf_logits(out, p.family.hf_class, tokens), megalite_logits(trained(p), tokens),
                        f"{p.family.name} to-hf of the trained checkpoint")


def assert_generation_equals_hf(p: Prepared, prompt_len: int = 8, new_tokens: int = 40) -> list[int]:
    """tools/generate.py --greedy (KV cache) on the imported checkpoint gives transformers' greedy tokens."""
    prompt = sample_tokens(p.family, batch=1, seed=13)[0, :prompt_len].tolist()
    gen = load_tool("generate")
    result = gen.run(["--load", p.imported, "--prompt", " ".join(map(str, prompt)), "--greedy", "--ignore-eod",
                      "--max-new-tokens", str(new_tokens), "--tokenizer-type", "NullTokenizer",
                      "--vocab-size", str(p.family.vocab - 1)], say=lambda s: None)
    ours = result.new_tokens[0]
    with torch.no_grad():
        hf = p.hf_model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, min_new_tokens=new_tokens)
    theirs = hf[0, prompt_len:].tolist()
    assert ours == theirs, f"{p.family.name}: generate.py {ours}\n transformers {theirs}"
    assert len(set(theirs)) > 3, f"{p.family.name}: greedy tokens too uniform to compare ({theirs})"
    return ours
