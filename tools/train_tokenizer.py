"""Train a tokenizer on local jsonl/text files (no hub needed).

    python tools/train_tokenizer.py --input corpus.jsonl --output-dir tok --vocab-size 8192
    python tools/train_tokenizer.py --input corpus.jsonl --type sentencepiece --output-dir tok

Byte-level BPE writes vocab.json + merges.txt (use with --tokenizer-type GPT2BPETokenizer) and
tokenizer.json (HuggingFaceTokenizer); SentencePiece writes tokenizer.model (SentencePieceTokenizer).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.config.domain import MAX_SIZE, count, domain_option, size  # noqa: E402
from megalite.data.tokenizer_training import iter_texts, train_bpe, train_sentencepiece  # noqa: E402
from megalite.launch.tool_errors import atomic_folder_files, tool_main  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="jsonl(.gz) or text files, or globs")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="jsonl keys holding the text")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--type", choices=["bpe", "sentencepiece"], default="bpe")
    domain_option(p, "--vocab-size", domain=size(MAX_SIZE), integer=True, default=8192)
    domain_option(p, "--min-frequency", domain=count(), integer=True, default=2,
                  help="BPE: least count of a merged pair")
    p.add_argument("--sentencepiece-model-type", choices=["bpe", "unigram"], default="bpe")
    args = p.parse_args(argv)
    return tool_main("train_tokenizer.py", lambda: _main(args),
                     interrupted=lambda: f"nothing written into {args.output_dir}")


def _main(args: argparse.Namespace) -> int:
    paths = []
    for pattern in args.input:
        found = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
        missing = [f for f in found if not os.path.isfile(f)]
        if not found or missing:
            print(f"error: --input {missing[0] if missing else pattern}: no such file", file=sys.stderr)
            return 1
        paths += found
    texts = iter_texts(paths, args.json_keys)
    # Trained into a folder beside --output-dir and moved in at the end: an interrupt or a failed write
    # leaves no partial tokenizer files.
    out_dir = args.output_dir
    try:
        with atomic_folder_files(out_dir) as tmp:
            if args.type == "bpe":
                out = train_bpe(texts, args.vocab_size, tmp, args.min_frequency)
                written = [out[k] for k in ("vocab_file", "merge_file", "tokenizer_json")]
            else:
                written = [train_sentencepiece(texts, args.vocab_size, os.path.join(tmp, "tokenizer"),
                                               args.sentencepiece_model_type)]
    except (ValueError, RuntimeError) as e:
        print(f"train_tokenizer.py: error: {e}", file=sys.stderr)
        return 1
    print("wrote " + ", ".join(os.path.join(out_dir, os.path.basename(w)) for w in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
