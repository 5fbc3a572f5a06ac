"""Data pipeline benchmarks.

1. Preprocessing throughput (tokens/s) on the embedded stdlib corpus with 1 and 2 workers, against
   the tokenizer's own batch encode of the same texts in one process (the ceiling).
2. GPT index build time (document + sample + shuffle index) for a synthetic ~1B-token dataset,
   megalite's vectorised numpy build against megatron-core's (C++ sample-index helper), and the
   end-to-end ``build_datasets`` start-up, cold (build + cache write) and warm (cache hit).

    python bench/bench_data.py                 # both
    python bench/bench_data.py --skip-preprocess --tokens 1e9
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.data import DataConfig, build_datasets  # noqa: E402
from megalite.data import gpt_indices as gi  # noqa: E402
from megalite.data.default_corpus import ensure_default_corpus  # noqa: E402
from megalite.data.indexed_dataset import IndexedDatasetWriter, bin_path  # noqa: E402
from megalite.data.preprocess import PreprocessOptions, preprocess  # noqa: E402
from megalite.data.tokenizer import GPT2BPETokenizer  # noqa: E402


def _cpu() -> float:
    t = os.times()  # this process (all threads) and its reaped children (pool workers)
    return t.user + t.system + t.children_user + t.children_system


def best_of(repeat: int, fn, cpu: bool = False):
    """Fastest wall time of ``repeat`` runs (and, with ``cpu``, the least CPU time: on a shared machine
    the CPU seconds per token are the steadier figure)."""
    walls, cpus, out = [], [], None
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), _cpu()
        out = fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(_cpu() - c0)
    return (min(walls), min(cpus), out) if cpu else (min(walls), out)


def bench_preprocess(work: str, corpus_dir: str, repeat: int) -> dict:
    paths = ensure_default_corpus(corpus_dir)
    jsonl = os.path.join(corpus_dir, "stdlib.jsonl")
    texts = [json.loads(line)["text"] for line in open(jsonl, encoding="utf-8")]
    tok = GPT2BPETokenizer(paths["vocab_file"], paths["merge_file"])
    ceiling_s, ceiling_cpu, ids = best_of(repeat, lambda: tok.tokenize_batch(texts), cpu=True)
    ntok = sum(len(x) + 1 for x in ids if x)  # + one eod per non-empty document
    res = {"documents": len(texts), "mbytes": os.path.getsize(jsonl) / 2**20, "tokens": ntok,
           "ceiling_tok_s": ntok / ceiling_s, "ceiling_tok_cpu_s": ntok / ceiling_cpu}
    fields = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": paths["vocab_file"],
              "merge_file": paths["merge_file"]}
    for workers in (1, 2):
        opts = PreprocessOptions(inputs=[jsonl], output_prefix=os.path.join(work, f"pp{workers}"),
                                 tokenizer=fields, append_eod=True, workers=workers, log_interval=1 << 30)
        secs, cpu, result = best_of(repeat, lambda o=opts: preprocess(o, log=lambda _m: None), cpu=True)
        assert result.num_tokens == ntok
        res[f"workers{workers}_tok_s"] = ntok / secs
        res[f"workers{workers}_tok_cpu_s"] = ntok / cpu
    return res


def synthetic_dataset(prefix: str, tokens: float, mean_doc: int, seed: int = 0) -> np.ndarray:
    """An .idx with realistic document lengths and a sparse .bin of the right size (no token data)."""
    rng = np.random.default_rng(seed)
    n = int(tokens / mean_doc)
    lengths = np.clip(rng.lognormal(np.log(mean_doc) - 0.5, 1.0, n), 1, 200_000).astype(np.int32)
    with IndexedDatasetWriter(prefix, np.int32) as w:
        w.add_documents(np.zeros(0, np.int32), lengths, np.ones(n, np.int64))
        w.finalize()
    with open(bin_path(prefix), "r+b") as f:
        f.truncate(int(lengths.sum(dtype=np.int64)) * 4)
    return lengths


def bench_indices(work: str, tokens: float, seq_length: int, epochs: float, repeat: int) -> dict:
    prefix = os.path.join(work, "synthetic")
    lengths = synthetic_dataset(prefix, tokens, mean_doc=600)
    total = int(lengths.sum(dtype=np.int64))
    docs = np.arange(len(lengths), dtype=np.int32)
    num_samples = int(epochs * (total - 1) // seq_length)
    res = {"documents": len(lengths), "tokens": total, "seq_length": seq_length, "num_samples": num_samples}

    ours_s, ours = best_of(repeat, lambda: gi.build_gpt_indices(lengths, docs, num_samples, seq_length, 1234))
    res["megalite_indices_s"] = ours_s

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        from megatron.core.datasets import gpt_dataset as mg
        from megatron.core.datasets import helpers

    def reference():
        # megatron-core's GPTDataset index build, step for step, on the same inputs.
        n_epochs = gi.num_epochs(total, num_samples, seq_length, True)
        separate = gi.separate_final_epoch(total, n_epochs, num_samples, seq_length, True)
        rng = np.random.RandomState(1234)
        doc_idx = mg._build_document_index(docs, n_epochs, rng, separate)
        sample_idx = helpers.build_sample_idx(lengths, doc_idx, seq_length, n_epochs, total, True, True)
        first = gi.samples_before_final_epoch(total, n_epochs, seq_length, True) if separate \
            else len(sample_idx) - 1
        return doc_idx, sample_idx, mg._build_shuffle_index(first, len(sample_idx) - 1, rng)

    ref_s, ref = best_of(repeat, reference)
    res["megatron_indices_s"] = ref_s
    res["identical"] = all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(ours, ref))

    # Blending indices for the same number of samples over three datasets (a Python loop here).
    weights = [0.5, 0.3, 0.2]
    res["megalite_blend_s"], (which, _) = best_of(1, lambda: gi.blending_indices(weights, num_samples))
    ref_which, ref_nth = np.zeros(num_samples, np.int16), np.zeros(num_samples, np.int64)
    res["megatron_blend_s"], _ = best_of(repeat, lambda: helpers.build_blending_indices(
        ref_which, ref_nth, weights, len(weights), num_samples, False))
    res["blend_identical"] = bool(np.array_equal(which, ref_which))

    cfg = DataConfig(data_path=[prefix], split="1,0,0", data_cache_path=os.path.join(work, "cache"))
    tok = type("Tok", (), {"vocab_size": 100_000, "eod": 0})()

    def startup():
        return build_datasets(cfg, seq_length=seq_length, seed=1234, num_samples=(num_samples, 0, 0),
                              tokenizer=tok, is_builder=True, barrier=None)

    res["build_datasets_cold_s"], _ = best_of(1, startup)
    res["build_datasets_warm_s"], _ = best_of(repeat, startup)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus-dir", default=os.path.join(tempfile.gettempdir(), "megalite-corpus"))
    p.add_argument("--tokens", type=float, default=1e9, help="synthetic dataset size for the index benchmark")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--epochs", type=float, default=1.0, help="samples requested, in epochs")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--skip-preprocess", action="store_true")
    p.add_argument("--skip-indices", action="store_true")
    args = p.parse_args()
    print(f"cpus: {os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="megalite-bench-") as work:
        if not args.skip_preprocess:
            r = bench_preprocess(work, args.corpus_dir, args.repeat)
            print(f"preprocess: {r['documents']} docs, {r['mbytes']:.1f} MB, {r['tokens']:,} tokens")
            for k in ("ceiling", "workers1", "workers2"):
                wall, cpu = r[f"{k}_tok_s"], r[f"{k}_tok_cpu_s"]
                print(f"  {k:9s} {wall:>10,.0f} tokens/s wall ({wall / r['ceiling_tok_s']:4.0%} of ceiling)"
                      f"  {cpu:>10,.0f} tokens per CPU-second")
        if not args.skip_indices:
            r = bench_indices(work, args.tokens, args.seq_length, args.epochs, args.repeat)
            print(f"GPT indices: {r['documents']:,} docs, {r['tokens']:,} tokens, seq {r['seq_length']}, "
                  f"{r['num_samples']:,} samples")
            print(f"  megalite (numpy)        {r['megalite_indices_s']:.3f} s")
            print(f"  megatron-core (C++)     {r['megatron_indices_s']:.3f} s   identical: {r['identical']}")
            print(f"  blend 3 datasets: megalite {r['megalite_blend_s']:.3f} s, megatron-core "
                  f"{r['megatron_blend_s']:.3f} s   identical: {r['blend_identical']}")
            print(f"  build_datasets cold     {r['build_datasets_cold_s']:.3f} s  "
                  "(open + check + hash + build + write)")
            print(f"  build_datasets warm     {r['build_datasets_warm_s']:.3f} s  (cache hit)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
