#!/usr/bin/env python
"""Zero-shot evaluation of a megalite checkpoint, with Megatron-LM's task flags and result lines.

    # perplexity (token and word level) of a text file, windows of --seq-length every --overlapping-eval
    python tasks/main.py --task WIKITEXT103 --valid-data wiki.test.tokens --load ckpt --overlapping-eval 32
    # last-word cloze accuracy on a jsonl of {"text": ...}
    python tasks/main.py --task LAMBADA --valid-data lambada_test.jsonl --load ckpt --strict-lambada
    # any layout gives the same numbers
    torchrun --nproc-per-node 4 tasks/main.py ... --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2

The model's shape and (by default) its tokenizer come from the checkpoint; tokenizer flags override it.
The last rank prints the result line (and ``--results-json`` keeps the full-precision numbers). See
docs/tasks.md for the formulas.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from megalite.config.domain import domain_option, size  # noqa: E402
from megalite.config.validate import ConfigError  # noqa: E402
from megalite.inference.evaluation import (  # noqa: E402
    count_words,
    detokenizer_for,
    evaluate_lambada,
    evaluate_perplexity,
    lambada_example,
    read_lambada,
)
from megalite.inference.loading import (  # noqa: E402
    InferencePlan,
    check_output_file,
    inference_parser,
    last_rank,
    load_model,
    plan,
    tokenize_checked,
)
from megalite.launch.run import distributed_run, exit_process, launcher_env  # noqa: E402
from megalite.launch.tool_errors import atomic_output, tool_main  # noqa: E402

TASKS = ("WIKITEXT103", "LAMBADA")


def build_parser():
    parser = inference_parser("Zero-shot evaluation (WikiText-103 perplexity, LAMBADA accuracy) of a checkpoint "
                              "at any TP/PP layout.")
    g = parser.tool
    g.add_argument("--task", required=True, choices=TASKS, help="What to evaluate.")
    g.add_argument("--valid-data", nargs="+", required=True,
                   help="WIKITEXT103: a text file; LAMBADA: a jsonl file of {\"text\": ...} lines.")
    domain_option(g, "--overlapping-eval", domain=size(), integer=True, default=32,
                   help="WIKITEXT103: windows start every this many tokens and score only their last this many "
                        "targets (Megatron's default 32; --seq-length for non-overlapping windows).")
    g.add_argument("--strict-lambada", action="store_true",
                   help="LAMBADA: the target is the whole last word (tokenized as ' word'), not its last token.")
    g.add_argument("--detokenizer", default="auto", choices=["auto", "wikitext", "ptb", "none"],
                   help="WIKITEXT103: undo the corpus' tokenized spacing first; 'auto' picks by file name as "
                        "Megatron does ('wiki' -> wikitext, 'ptb' -> ptb, else none).")
    g.add_argument("--results-json", default=None, help="Also write the results, full precision, to this file.")
    return parser


def prepare(task_args, p: InferencePlan):
    """Read and tokenize the task's data (on every rank, before any communication)."""
    if len(task_args.valid_data) != 1:
        raise ConfigError(f"--valid-data takes one file for {task_args.task}, got {len(task_args.valid_data)}")
    path = task_args.valid_data[0]
    text = read_utf8(path)
    seq = p.cfg.model.seq_length
    tok = p.tokenizer
    if task_args.task == "WIKITEXT103":
        if not 1 <= task_args.overlapping_eval <= seq:
            raise ConfigError(f"--overlapping-eval ({task_args.overlapping_eval}) must be in [1, --seq-length "
                              f"({seq})]")
        words = count_words(text)
        tokens = tokenize_checked(tok, detokenizer_for(path, task_args.detokenizer)(text), p.vocab_size,
                                  f"--valid-data {path}")
        if len(tokens) < 2:
            raise ConfigError(f"--valid-data {path}: needs at least 2 tokens, has {len(tokens)}")
        return tokens, words
    try:
        texts = read_lambada(path)
        return [lambada_example(t, lambda s, i=i: tokenize_checked(tok, s, p.vocab_size,
                                                                   f"--valid-data {path}, example {i}"),
                                task_args.strict_lambada, seq) for i, t in enumerate(texts, 1)]
    except ValueError as e:
        raise ConfigError(str(e)) from None


def read_utf8(path: str) -> str:
    """The text of --valid-data; a missing file, a folder or bytes that are not UTF-8 are named (with the
    line of the first bad byte)."""
    if os.path.isdir(path):
        raise ConfigError(f"--valid-data {path} is a directory; give the task's data file")
    if not os.path.isfile(path):
        raise ConfigError(f"--valid-data {path}: no such file")
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"--valid-data {path}, line {line}: not UTF-8 text (byte {e.start}: {e.reason}); "
                          "the tasks read UTF-8 text files") from None


def run(argv: list[str] | None = None, say=print):
    """Parse, check, evaluate; the result object on every rank (printed by the last one)."""
    given, task_args = build_parser().parse(argv)
    _, world, _, _ = launcher_env()
    check_output_file("--results-json", task_args.results_json)
    p = plan(given, world)
    data = prepare(task_args, p)
    with distributed_run(p.cfg) as pg:
        chunks = load_model(p, pg)
        mbs, seq, pad = p.cfg.training.micro_batch_size, p.cfg.model.seq_length, p.tokenizer.eod
        talk = say if last_rank(pg) else (lambda s: None)
        if task_args.task == "WIKITEXT103":
            tokens, words = data
            talk(f" > number of original tokens: {words}, number of detokenized tokens: {len(tokens)}")
            result = evaluate_perplexity(chunks, pg, tokens, words, seq, task_args.overlapping_eval, mbs, pad)
        else:
            talk(f" > found {len(data)} samples.")
            result = evaluate_lambada(chunks, pg, data, mbs, pad)
        talk(result.line(task_args.task))
        if task_args.results_json and last_rank(pg):
            with atomic_output(task_args.results_json) as tmp, open(tmp, "w") as f:
                json.dump({"task": task_args.task, "load": p.load, "iteration": p.iteration,
                           "tp": pg.tp_size, "pp": pg.pp_size, "dp": pg.dp_size, **result.as_dict()}, f, indent=1)
    return result


def main(argv: list[str] | None = None) -> int:
    return tool_main("tasks/main.py", lambda: _main(argv), error_status=2)


def _main(argv: list[str] | None) -> int:
    try:
        run(argv)
    except ConfigError as e:
        print(f"tasks/main.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    exit_process(main())
