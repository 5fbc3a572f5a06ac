"""Concatenate several indexed datasets (``.bin/.idx`` prefixes) into one, in the order given.

    python tools/merge_datasets.py --input data/part_0_text_document data/part_1_text_document \\
        --output-prefix data/all_text_document
    python tools/merge_datasets.py --input data/parts/ --output-prefix data/all_text_document

A folder stands for every prefix in it (sorted). All inputs must share a token dtype.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter, exists  # noqa: E402
from megalite.launch.tool_errors import tool_main  # noqa: E402


def input_prefixes(inputs: list[str]) -> list[str]:
    prefixes = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(os.path.join(item, f[:-4]) for f in os.listdir(item) if f.endswith(".idx"))
            if not found:
                raise FileNotFoundError(f"--input {item}: no .idx files in this folder")
            prefixes += found
        else:
            prefixes.append(item[:-4] if item.endswith((".bin", ".idx")) else item)
    for p in prefixes:
        if not exists(p):
            raise FileNotFoundError(f"--input {p}: needs both {p}.bin and {p}.idx")
    return prefixes


def merge(prefixes: list[str], output_prefix: str) -> None:
    if os.path.abspath(output_prefix) in {os.path.abspath(p) for p in prefixes}:
        raise ValueError(f"--output-prefix {output_prefix} is also an input")
    dtype = IndexedDataset(prefixes[0]).dtype
    with IndexedDatasetWriter(output_prefix, dtype) as writer:
        for p in prefixes:
            writer.add_index(p)
        writer.finalize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="dataset prefixes, or folders of them")
    p.add_argument("--output-prefix", required=True)
    args = p.parse_args(argv)
    return tool_main("merge_datasets.py", lambda: _main(args),
                     interrupted=lambda: f"nothing written (no {args.output_prefix}.bin/.idx)")


def _main(args: argparse.Namespace) -> int:
    try:
        prefixes = input_prefixes(args.input)
        merge(prefixes, args.output_prefix)
    except ValueError as e:
        print(f"merge_datasets.py: error: {e}", file=sys.stderr)
        return 1
    print(f"merged {len(prefixes)} datasets into {args.output_prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
