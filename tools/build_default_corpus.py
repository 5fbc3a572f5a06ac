"""Build the embedded default corpus (Python standard library source and docstrings) with its
tokenizer and preprocessed data, with no network access.

    python tools/build_default_corpus.py --output-dir corpus
    python pretrain_gpt.py --data-path corpus/stdlib_text_document --tokenizer-type GPT2BPETokenizer \\
        --vocab-file corpus/vocab.json --merge-file corpus/merges.txt ...
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.config.domain import MAX_RANKS, MAX_SIZE, domain_option, positive, size  # noqa: E402
from megalite.data.default_corpus import VOCAB_SIZE, build_default_corpus, ensure_default_corpus  # noqa: E402
from megalite.launch.tool_errors import tool_main  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output-dir", default="corpus")
    domain_option(p, "--vocab-size", domain=size(MAX_SIZE), integer=True, default=VOCAB_SIZE)
    domain_option(p, "--max-mb", domain=positive(MAX_SIZE), integer=False, default=None,
                  help="stop after this much text (default: all)")
    domain_option(p, "--workers", domain=size(MAX_RANKS), integer=True, default=2)
    p.add_argument("--force", action="store_true", help="rebuild even if the corpus exists")
    args = p.parse_args(argv)
    return tool_main("build_default_corpus.py", lambda: _main(args),
                     interrupted=lambda: f"{args.output_dir} was not (re)built; its old files are as they were")


def _main(args: argparse.Namespace) -> int:
    kwargs = dict(vocab_size=args.vocab_size, workers=args.workers,
                  max_bytes=None if args.max_mb is None else int(args.max_mb * 2**20))
    try:
        paths = build_default_corpus(args.output_dir, **kwargs) if args.force else \
            ensure_default_corpus(args.output_dir, **kwargs)
    except ValueError as e:
        print(f"build_default_corpus.py: error: {e}", file=sys.stderr)
        return 1
    print(f"--data-path {paths['data_path']} --tokenizer-type GPT2BPETokenizer "
          f"--vocab-file {paths['vocab_file']} --merge-file {paths['merge_file']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
