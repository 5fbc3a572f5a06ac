"""Zero-shot evaluation with Megatron-LM's semantics: language-model perplexity over sliding windows
(WikiText-103) and last-word cloze accuracy (LAMBADA).

Perplexity. The text's tokens t_0..t_N are cut into windows of ``seq_length`` + 1 tokens starting every
``overlapping_eval`` tokens. The first window scores all its targets; every later one scores only its
last ``overlapping_eval`` targets (the others were scored by an earlier window, now with a longer
context), so each of the N targets is scored exactly once. With the summed loss L:

    avg loss = L / N              token ppl = exp(min(20, avg loss))
    token ratio = N / (W - 1)     word ppl  = exp(min(20, avg loss * token ratio))   ("adjusted ppl")

where W is the number of words of the original text, counted as Megatron does: ``len(text.strip().split(" "))``
(split on single spaces, before detokenizing).

LAMBADA. Each example's context is followed by its target; it counts as correct only when the greedy
prediction equals the target at every target position. Plain mode: the target is the text's last
token. ``strict``: the target is the whole last word, tokenized as ``" " + word``, and the context is the
text before it (stripped), tokenized on its own.

Examples are dealt to data-parallel replicas in contiguous blocks; each example's score lands in its own
slot of a vector that is summed over DP (one non-zero term per slot, so exact), and totals are summed in
example order in float64: the numbers do not depend on DP size or micro-batch size.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from megalite.config.strict_load import StrictReadError, load_json
from megalite.inference.pipeline import from_last_stage, pipeline_forward
from megalite.parallel.groups import Group, ProcessGroups

# ---- detokenizers (undo WikiText's / PTB's tokenized spacing before our tokenizer sees the text) -----


def wikitext_detokenize(text: str) -> str:
    text = text.replace("s '", "s'")
    text = re.sub(r"/' [0-9]/", r"/'[0-9]/", text)
    for a, b in ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."), (" : ", ": "), (" ; ", "; "), (" . ", ". "),
                 (" ! ", "! "), (" ? ", "? "), (" , ", ", ")):
        text = text.replace(a, b)
    text = re.sub(r"\(\s*([^\)]*?)\s*\)", r"(\1)", text)
    text = re.sub(r"\[\s*([^\]]*?)\s*\]", r"[\1]", text)
    text = re.sub(r"{\s*([^}]*?)\s*}", r"{\1}", text)
    text = re.sub(r"\"\s*([^\"]*?)\s*\"", r'"\1"', text)
    text = re.sub(r"'\s*([^']*?)\s*'", r"'\1'", text)
    for a, b in (("= = = =", "===="), ("= = =", "==="), ("= =", "=="), (" \N{DEGREE SIGN} ", "\N{DEGREE SIGN}"),
                 (" \n", "\n"), ("\n ", "\n"), (" N ", " 1 "), (" 's", "'s")):
        text = text.replace(a, b)
    return text


def ptb_detokenize(text: str) -> str:
    for a, b in ((" '", "'"), (" \n", "\n"), ("\n ", "\n"), (" n't", "n't"), (" N ", "1 "), ("$ 1", "$1"),
                 ("# 1", "#1")):
        text = text.replace(a, b)
    return text


DETOKENIZERS: dict[str, Callable[[str], str]] = {"wikitext": wikitext_detokenize, "ptb": ptb_detokenize,
                                                 "none": lambda s: s}


def detokenizer_for(path: str, name: str = "auto") -> Callable[[str], str]:
    """``name`` or, for 'auto', Megatron's choice by file name: 'ptb' -> PTB, 'wiki' -> WikiText, else none."""
    if name != "auto":
        return DETOKENIZERS[name]
    if "ptb" in path:
        return ptb_detokenize
    if "wiki" in path:
        return wikitext_detokenize
    return DETOKENIZERS["none"]


def count_words(text: str) -> int:
    """Megatron's word count of the original (not detokenized) text."""
    return len(text.strip().split(" "))


# ---- examples --------------------------------------------------------------------------------------


@dataclass
class Example:
    """``tokens`` (input + target, at most seq_length + 1) and the target positions scored (in labels,
    i.e. position j scores the prediction of tokens[j + 1])."""

    tokens: list[int]
    scored: range


def lm_windows(tokens: Sequence[int], seq_length: int, overlapping_eval: int | None) -> list[Example]:
    """Megatron's sliding windows over ``tokens`` (see the module doc); every target scored once."""
    ov = seq_length if overlapping_eval is None else max(1, overlapping_eval)
    if ov > seq_length:
        raise ValueError(f"--overlapping-eval ({ov}) must be <= --seq-length ({seq_length}): larger strides skip "
                         "tokens")
    targets = len(tokens) - 1
    count = max(math.ceil(max(targets - ov, 0) / ov) + 1, 1)
    out = []
    for i in range(count):
        start = i * ov
        window = list(tokens[start: start + seq_length + 1])
        n = len(window) - 1  # real targets in this window
        first = 0 if i == 0 else seq_length - ov
        out.append(Example(window, range(min(first, max(n, 0)), max(n, 0))))
    return out


def lambada_example(text: str, tokenize: Callable[[str], list[int]], strict: bool, seq_length: int) -> Example:
    """One LAMBADA text -> context + target tokens (Megatron's rules, see the module doc). A context too
    long for ``seq_length`` keeps its end."""
    if strict:
        word = text.split()[-1]
        start = text.rfind(word)
        context, target = tokenize(text[:start].strip()), tokenize(" " + word)
    else:
        ids = tokenize(text)
        context, target = ids[:-1], ids[-1:]
    if not context or not target:
        raise ValueError(f"LAMBADA example has no context or no target: {text[:80]!r}")
    if len(target) > seq_length:
        raise ValueError(f"LAMBADA target of {len(target)} tokens does not fit --seq-length {seq_length}")
    tokens = (context + target)[-(seq_length + 1):]
    return Example(tokens, range(len(tokens) - 1 - len(target), len(tokens) - 1))


def read_lambada(path: str) -> list[str]:
    """The "text" of every line of a LAMBADA jsonl; a line that is not a JSON object whose "text" is a
    non-empty string (a number, a list, a key written twice) is named with its line."""
    texts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = load_json(line, f"{path}:{n}")
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: expected a JSON object with a 'text' field ({e})") from None
            except StrictReadError as e:
                raise ValueError(str(e)) from None
            if not isinstance(obj, dict) or "text" not in obj:
                got = f"keys {sorted(obj)[:5]}" if isinstance(obj, dict) else type(obj).__name__
                raise ValueError(f"{path}:{n}: expected a JSON object with a 'text' field, got {got}")
            text = obj["text"]
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{path}:{n}: 'text' must be a non-empty string, got {type(text).__name__} "
                                 f"{str(text)[:40]!r}")
            texts.append(text)
    if not texts:
        raise ValueError(f"{path}: no examples")
    return texts


# ---- scoring ---------------------------------------------------------------------------------------


def _batch(examples: Sequence[Example], pad: int, device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs [b, s], labels [b, s], mask [b, s]) padded to the longest example."""
    s = max(len(e.tokens) for e in examples) - 1
    full = torch.full((len(examples), s + 1), pad, dtype=torch.long)
    mask = torch.zeros(len(examples), s, dtype=torch.bool)
    for i, e in enumerate(examples):
        full[i, : len(e.tokens)] = torch.as_tensor(e.tokens)
        mask[i, e.scored.start: e.scored.stop] = True
    full, mask = full.to(device), mask.to(device)
    return full[:, :-1].contiguous(), full[:, 1:].contiguous(), mask


def cloze_correct(predictions: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1.0 per row whose predictions [b, s] equal the labels at every masked position, else 0.0."""
    return ((predictions == labels) | ~mask).all(dim=-1).double()


@torch.no_grad()
def score_examples(chunks: list[nn.Module], pg: ProcessGroups, examples: Sequence[Example], metric: str,
                   micro_batch_size: int, pad: int) -> torch.Tensor:
    """Per-example scores, float64 [n], on every rank: 'loss' = summed CE over the scored targets,
    'accuracy' = 1 if every scored target is the greedy prediction. Call on every rank."""
    if metric not in ("loss", "accuracy"):
        raise ValueError(f"metric must be 'loss' or 'accuracy', got {metric!r}")
    for c in chunks:
        c.eval()
    device = next(chunks[0].parameters()).device
    n, dp = len(examples), pg.dp_size
    per = math.ceil(n / dp)
    mine = range(pg.dp_rank * per, min(n, (pg.dp_rank + 1) * per))
    scores = torch.zeros(n, dtype=torch.float64, device=device)
    vocab = chunks[-1].vocab_size
    for lo in range(mine.start, mine.stop, micro_batch_size):
        idx = list(range(lo, min(lo + micro_batch_size, mine.stop)))
        inputs, labels, mask = _batch([examples[i] for i in idx], pad, device)
        if metric == "loss":
            out = pipeline_forward(chunks, pg, inputs, labels=labels)
            if out is not None:
                scores[idx] = (out.double() * mask).sum(dim=-1)
        else:
            out = pipeline_forward(chunks, pg, inputs)
            if out is not None:
                scores[idx] = cloze_correct(out[..., :vocab].argmax(dim=-1), labels, mask)
    pg.all_reduce(scores, Group.DP)  # one contributor per slot
    return from_last_stage(scores if pg.is_last_stage else None, pg, (n,), torch.float64, device)


@dataclass
class PerplexityResult:
    total_loss: float
    num_tokenized_tokens: int
    num_original_tokens: int
    num_windows: int

    @property
    def num_targets(self) -> int:
        return self.num_tokenized_tokens - 1

    @property
    def avg_loss(self) -> float:
        if self.num_targets < 1:  # no target scored: no loss (not 0, perplexity 1)
            raise ValueError(f"perplexity over {self.num_tokenized_tokens} token(s) scores no target: the text "
                             "needs at least 2 tokens")
        return self.total_loss / self.num_targets

    @property
    def ppl(self) -> float:
        return math.exp(min(20.0, self.avg_loss))

    @property
    def token_ratio(self) -> float:
        return self.num_targets / max(self.num_original_tokens - 1, 1)

    @property
    def adjusted_ppl(self) -> float:
        return math.exp(min(20.0, self.avg_loss * self.token_ratio))

    def line(self, task: str) -> str:
        """Megatron's result line."""
        return (f" validation results on {task} | avg loss: {self.avg_loss:.4E} | ppl: {self.ppl:.4E} | "
                f"adjusted ppl: {self.adjusted_ppl:.4E} | token ratio: {self.token_ratio} |")

    def as_dict(self) -> dict:
        return {"avg_loss": self.avg_loss, "token_ppl": self.ppl, "word_ppl": self.adjusted_ppl,
                "token_ratio": self.token_ratio, "num_tokenized_tokens": self.num_tokenized_tokens,
                "num_original_tokens": self.num_original_tokens, "num_windows": self.num_windows}


@dataclass
class AccuracyResult:
    correct: float
    total: int

    @property
    def accuracy(self) -> float:
        if self.total < 1:  # no example scored: no accuracy (not 0)
            raise ValueError("LAMBADA accuracy over no example: --valid-data holds no example to score")
        return self.correct / self.total

    def line(self, task: str) -> str:
        return (f" validation results on {task} | number correct: {self.correct:.4E} | total examples: "
                f"{self.total:.4E} | avg accuracy: {self.accuracy:.4E}")

    def as_dict(self) -> dict:
        return {"correct": self.correct, "total": self.total, "accuracy": self.accuracy}


def evaluate_perplexity(chunks: list[nn.Module], pg: ProcessGroups, tokens: Sequence[int], num_original_tokens: int,
                        seq_length: int, overlapping_eval: int | None, micro_batch_size: int, pad: int
                        ) -> PerplexityResult:
    if len(tokens) < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, the text has {len(tokens)}")
    windows = lm_windows(tokens, seq_length, overlapping_eval)
    scores = score_examples(chunks, pg, windows, "loss", micro_batch_size, pad)
    return PerplexityResult(math.fsum(scores.tolist()), len(tokens), num_original_tokens, len(windows))


def evaluate_lambada(chunks: list[nn.Module], pg: ProcessGroups, examples: Sequence[Example], micro_batch_size: int,
                     pad: int) -> AccuracyResult:
    scores = score_examples(chunks, pg, examples, "accuracy", micro_batch_size, pad)
    return AccuracyResult(math.fsum(scores.tolist()), len(examples))
