"""Promises: preprocessing reproduces every document's tokens (+eod) in Megatron's format whatever the
number of workers or input layout (files, globs, .gz, parquet, saved datasets); bad input stops with
file:line and the reason (or is counted with --skip-bad-lines); empty input and unwritable outputs fail
before tokenizing; a failed run never leaves an .idx behind."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.inputs import InputError
from megalite.data.preprocess import PreprocessOptions, preprocess
from megalite.data.tokenizer import GPT2BPETokenizer
from tests.data_fixtures import bpe_fields, corpus_texts, import_mcore, scratch_dir, tiny_bpe, write_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(inputs, out, logs=None, **kw):
    opts = PreprocessOptions(inputs=list(inputs), output_prefix=out, tokenizer=bpe_fields(), **kw)
    return preprocess(opts, log=(logs.append if logs is not None else lambda _m: None))


def tokenizer():
    t = tiny_bpe()
    return GPT2BPETokenizer(t["vocab_file"], t["merge_file"])


def files(prefix):
    return [open(prefix + ext, "rb").read() for ext in (".bin", ".idx")]


@pytest.fixture(scope="module")
def corpus_jsonl():
    d = scratch_dir("pp-corpus")
    rows = [{"text": t, "id": i} for i, t in enumerate(corpus_texts())]
    return write_jsonl(os.path.join(d, "corpus.jsonl"), rows)


@pytest.fixture(scope="module")
def reference(corpus_jsonl):
    """The corpus preprocessed with 2 workers (and --append-eod), the other tests' reference output."""
    out = os.path.join(scratch_dir("pp-ref"), "ref")
    logs = []
    result = run([corpus_jsonl], out, logs, append_eod=True, workers=2, log_interval=5)
    return out + "_text_document", result, logs


def test_round_trip_tokens_plus_eod_and_megatron_reads_it(reference):
    prefix, result, logs = reference
    tok = tokenizer()
    texts = corpus_texts()
    ours = IndexedDataset(prefix)
    _, _, _, mi, _ = import_mcore()
    ref = mi.IndexedDataset(prefix)
    assert ours.dtype == np.uint16 and result.num_docs == len(texts) == ours.num_documents
    seq = 0
    for text in texts:
        expected = tok.tokenize(text) + [tok.eod] if text else []
        if expected:
            assert ours[seq].tolist() == expected and ref[seq].tolist() == expected
            assert tok.detokenize(expected[:-1]) == text
            seq += 1
    assert seq == len(ours)  # the empty text is an empty document: no sequence
    assert any("docs/s" in line and "MB/s" in line for line in logs)
    assert "tokens/s" in logs[-1]


def test_output_does_not_depend_on_workers_or_input_layout(reference, corpus_jsonl):
    prefix, _, _ = reference
    d = scratch_dir("pp-layout")
    rows = [json.loads(line) for line in open(corpus_jsonl)]
    # Three parts: plain, gzipped, and a glob; processed in order they equal the one file.
    write_jsonl(os.path.join(d, "a_0.jsonl"), rows[:10])
    with gzip.open(os.path.join(d, "a_1.jsonl.gz"), "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows[10:25])
    write_jsonl(os.path.join(d, "b_2.jsonl"), rows[25:])
    run([os.path.join(d, "a_*"), os.path.join(d, "b_2.jsonl")], os.path.join(d, "multi"),
        append_eod=True, workers=1)
    assert files(os.path.join(d, "multi_text_document")) == files(prefix)


def test_hf_saved_dataset_and_parquet_inputs(reference, corpus_jsonl):
    import datasets

    prefix, _, _ = reference
    d = scratch_dir("pp-hf")
    rows = [json.loads(line) for line in open(corpus_jsonl)]
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(os.path.join(d, "saved"))
    ds.to_parquet(os.path.join(d, "data.parquet"))
    run([os.path.join(d, "saved")], os.path.join(d, "from_saved"), append_eod=True, workers=2)
    run([os.path.join(d, "data.parquet")], os.path.join(d, "from_parquet"), append_eod=True)
    arrow = sorted(f for f in os.listdir(os.path.join(d, "saved")) if f.endswith(".arrow"))
    run([os.path.join(d, "saved", f) for f in arrow], os.path.join(d, "from_arrow"), append_eod=True)
    for name in ("from_saved", "from_parquet", "from_arrow"):
        assert files(os.path.join(d, f"{name}_text_document")) == files(prefix), name


def test_several_keys_and_sentence_lists():
    d = scratch_dir("pp-keys")
    rows = [{"text": ["first sentence.", "", "second one."], "title": "T1"}, {"text": "plain", "title": ""}]
    run([write_jsonl(os.path.join(d, "in.jsonl"), rows)], os.path.join(d, "o"), json_keys=["text", "title"],
        append_eod=True)
    tok = tokenizer()
    text = IndexedDataset(os.path.join(d, "o_text_document"))
    assert text.document_indices.tolist() == [0, 2, 3]  # empty sentences are dropped, as in Megatron
    assert text[0].tolist() == tok.tokenize("first sentence.")
    assert text[1].tolist() == tok.tokenize("second one.") + [tok.eod]
    title = IndexedDataset(os.path.join(d, "o_title_document"))
    assert title.document_indices.tolist() == [0, 1, 1]
    assert title[0].tolist() == tok.tokenize("T1") + [tok.eod]


def test_a_full_disk_on_a_later_key_leaves_no_key_written(monkeypatch):
    """Several --json-keys finish together: when the second key's index cannot be written (a full disk), the
    first key's output is not left standing alone, and nothing else is left behind."""
    import errno

    from megalite.data.indexed_dataset import IndexedDatasetWriter

    d = scratch_dir("pp-keys-full")
    rows = [{"text": "plain", "title": "T1"}]
    real, calls = IndexedDatasetWriter.write_index, []

    def full_on_second(self):
        calls.append(self.prefix)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self)

    monkeypatch.setattr(IndexedDatasetWriter, "write_index", full_on_second)
    with pytest.raises(OSError):
        run([write_jsonl(os.path.join(d, "in.jsonl"), rows)], os.path.join(d, "o"), json_keys=["text", "title"])
    assert sorted(os.listdir(d)) == ["in.jsonl"]


def _bad_input(d):
    rows = [{"text": "good one"}, {"text": "good two"}, None, {"other": "x"}, {"text": 5}, {"text": "ok"}]
    return write_jsonl(os.path.join(d, "bad.jsonl"), rows, raw_lines={2: '{"text": "unterminated'})


def test_bad_line_stops_with_file_line_and_reason_and_leaves_no_idx():
    d = scratch_dir("pp-bad")
    with pytest.raises(InputError, match=r"bad\.jsonl:3: malformed JSON"):
        run([_bad_input(d)], os.path.join(d, "out"))
    assert sorted(os.listdir(d)) == ["bad.jsonl"]  # no .idx, no .bin, no temporaries


@pytest.mark.parametrize("rows,message", [
    ([{"other": "x"}], r"in\.jsonl:1: missing key 'text'"),
    ([{"text": "a"}, {"text": 5}], r"in\.jsonl:2: key 'text' holds int, expected a string"),
    ([{"text": "a"}, [1, 2]], r"in\.jsonl:2: expected a JSON object, got list"),
])
def test_each_bad_row_kind_is_named(rows, message):
    d = scratch_dir("pp-kinds")
    with pytest.raises(InputError, match=message):
        run([write_jsonl(os.path.join(d, "in.jsonl"), rows)], os.path.join(d, "out"))


def test_skip_bad_lines_counts_and_reports():
    d = scratch_dir("pp-skip")
    logs = []
    result = run([_bad_input(d)], os.path.join(d, "out"), logs, skip_bad_lines=True)
    assert result.num_docs == 3 and [r for _, r, _ in result.skipped] == [3, 4, 5]
    assert any("Skipped 3 bad lines; first:" in line and "bad.jsonl:3" in line for line in logs)
    assert IndexedDataset(os.path.join(d, "out_text_document")).num_documents == 3


def test_null_tokenizer_ids_outside_vocab_are_bad_rows():
    d = scratch_dir("pp-null")
    path = write_jsonl(os.path.join(d, "in.jsonl"), [{"text": "1 2 3"}, {"text": "4 99"}, {"text": "x"}])
    opts = PreprocessOptions(inputs=[path], output_prefix=os.path.join(d, "o"),
                             tokenizer={"tokenizer_type": "NullTokenizer", "vocab_size": 50})
    with pytest.raises(InputError, match=r"in\.jsonl:2: token id 99 outside the vocabulary \[0, 51\)"):
        preprocess(opts, log=lambda _m: None)
    opts.skip_bad_lines = True
    result = preprocess(opts, log=lambda _m: None)
    assert result.num_docs == 1 and "cannot tokenize" in result.skipped[1][2]


def test_empty_input_and_unwritable_output_fail_before_tokenizing(monkeypatch):
    import megalite.data.preprocess as pp

    monkeypatch.setattr(pp, "_run", lambda *a: pytest.fail("tokenizing started"))
    d = scratch_dir("pp-early")
    empty = os.path.join(d, "empty.jsonl")
    open(empty, "w").write("\n  \n")
    with pytest.raises(InputError, match=r"input is empty: no rows in .*empty\.jsonl"):
        run([empty], os.path.join(d, "o"))
    with pytest.raises(InputError, match=r"matches no files"):
        run([os.path.join(d, "nothing*.jsonl")], os.path.join(d, "o"))
    with pytest.raises(InputError, match=r"no such file or directory"):
        run([os.path.join(d, "missing.jsonl")], os.path.join(d, "o"))
    good = write_jsonl(os.path.join(d, "good.jsonl"), [{"text": "hi"}])
    with pytest.raises(FileNotFoundError, match=r"output directory .*nodir does not exist"):
        run([good], os.path.join(d, "nodir", "o"))
    # Unwritable output (a directory squats on the temporary name; works even as root).
    os.mkdir(os.path.join(d, f"o_text_document.bin.tmp-{os.getpid()}"))
    with pytest.raises(PermissionError, match=r"cannot write .*o_text_document\.bin"):
        run([good], os.path.join(d, "o"))
    with pytest.raises(InputError, match=r"no column 'body'"):
        import datasets

        datasets.Dataset.from_list([{"text": "x"}]).to_parquet(os.path.join(d, "t.parquet"))
        run([os.path.join(d, "t.parquet")], os.path.join(d, "o"), json_keys=["body"])


def test_cli_matches_done_when_command(corpus_jsonl, reference):
    """The issue's command line, run as a user would, writes files megatron-core reads back."""
    prefix, _, _ = reference
    d = scratch_dir("pp-cli")
    t = tiny_bpe()
    shutil.copy(corpus_jsonl, os.path.join(d, "X.jsonl"))
    cmd = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", "X.jsonl",
           "--output-prefix", "out", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", t["vocab_file"],
           "--merge-file", t["merge_file"], "--append-eod", "--workers", "2"]
    out = subprocess.run(cmd, cwd=d, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert files(os.path.join(d, "out_text_document")) == files(prefix)
    bad_cmd = cmd[:2] + ["--input", "missing.jsonl"] + cmd[4:]
    bad = subprocess.run(bad_cmd, cwd=d, capture_output=True, text=True)
    assert bad.returncode == 1 and "error: --input missing.jsonl: no such file" in bad.stderr
    assert "Traceback" not in bad.stderr
