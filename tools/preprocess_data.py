"""Tokenize text into Megatron's indexed format: ``{output_prefix}_{key}_document.bin/.idx``.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 2

``--input`` takes jsonl files (optionally .gz), globs, parquet/arrow files and folders saved by
Hugging Face ``datasets``; several may be given and become one output, in order.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.config.domain import MAX_RANKS, MAX_SIZE, count, domain_option, size  # noqa: E402
from megalite.data.preprocess import PreprocessOptions, preprocess  # noqa: E402
from megalite.data.tokenizer import TOKENIZER_TYPES  # noqa: E402
from megalite.launch.tool_errors import tool_main  # noqa: E402


def add_tokenizer_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file", help="GPT-2 BPE vocab.json")
    g.add_argument("--merge-file", help="GPT-2 BPE merges.txt")
    g.add_argument("--tokenizer-model", help="tokenizer.json / tokenizer folder, or SentencePiece .model")
    domain_option(g, "--vocab-size", domain=size(MAX_SIZE - 1), integer=True, help="NullTokenizer: ids 0..V-1, eod V")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("input")
    g.add_argument("--input", nargs="+", required=True,
                   help="jsonl(.gz) files, globs, parquet/arrow files or saved-dataset folders")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys (columns) to tokenize; one output each")
    g.add_argument("--skip-bad-lines", action="store_true",
                   help="skip (and count) malformed rows instead of stopping at the first")
    add_tokenizer_flags(p)
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True, help="output path without the _{key}_document suffix")
    g.add_argument("--append-eod", action="store_true", help="end every document with the eod token")
    g = p.add_argument_group("runtime")
    domain_option(g, "--workers", domain=size(MAX_RANKS), integer=True, default=1, help="tokenizing processes")
    domain_option(g, "--log-interval", domain=count(), integer=True, default=1000,
                  help="documents between progress lines")
    domain_option(g, "--partitions", domain=size(MAX_RANKS), integer=True, default=1,
                   help="accepted for compatibility; inputs are streamed, so partitions are not needed")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return tool_main("preprocess_data.py", lambda: _main(args),
                     interrupted=lambda: f"nothing written (no {args.output_prefix}_*_document.bin/.idx)")


def _main(args: argparse.Namespace) -> int:
    opts = PreprocessOptions(
        inputs=args.input, output_prefix=args.output_prefix, json_keys=args.json_keys,
        append_eod=args.append_eod, workers=args.workers, log_interval=args.log_interval,
        skip_bad_lines=args.skip_bad_lines,
        tokenizer={k: getattr(args, k) for k in
                   ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "vocab_size")})
    try:
        result = preprocess(opts)
    except ValueError as e:
        print(f"preprocess_data.py: error: {e}", file=sys.stderr)
        return 1
    for key, prefix in result.outputs.items():
        print(f"wrote {prefix}.bin and {prefix}.idx ({key})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
