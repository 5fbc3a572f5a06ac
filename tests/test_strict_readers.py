"""Every reader of a JSON, JSONL, YAML, parquet or tokenizer file a user hands megalite goes through one
strict reader: a key written twice (a column named twice) is refused by name instead of resolved in silence,
nesting past the bound is a named error instead of a RecursionError traceback, and a YAML file of nested
aliases is refused instead of hanging. The readers are enumerated once (READERS); each rule runs over every
reader it applies to."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from tests.cli_utils import load_tool

# main() run in-process under capsys: torch's @record cannot attach its fault handler there.
pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")

BASE = ["--mock-data", "--vocab-size", "64", "--train-iters", "2", "--num-layers", "2", "--hidden-size", "16",
        "--num-attention-heads", "2", "--seq-length", "8"]
DEPTH = 3000  # past the bound and past Python's recursion limit


DEEP = "[" * DEPTH + "]" * DEPTH


def _message(fn: Callable[[], object], capsys) -> str:
    """The one-line message ``fn`` stops with: an exception's text, or a tool's stderr (exit code != 0)."""
    try:
        rc = fn()
    except SystemExit as e:
        rc = e.code
    except RecursionError:
        raise AssertionError("a RecursionError escaped the reader") from None
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        assert "Traceback" not in str(e)
        return str(e)
    err = capsys.readouterr().err
    assert rc not in (0, None), f"accepted: {err[-2000:]}"
    assert "Traceback" not in err, err[-3000:]
    return err


# --- the readers: each writes ``text`` where its entry point reads it, and reads it -----------------------

def _pretrain_config(suffix: str):
    def read(tmp_path, text):
        from megalite.config.arguments import parse_args

        path = tmp_path / f"run{suffix}"
        path.write_text(text)
        return lambda: parse_args([*BASE, "--config", str(path)])
    return read


def _deepspeed_config(tmp_path, text):
    from megalite.config.arguments import parse_args

    path = tmp_path / "ds.json"
    path.write_text(text)
    return lambda: parse_args([*BASE, "--deepspeed-config", str(path)])


def _vocab_json(tmp_path, text):
    from megalite.data.tokenizer import GPT2BPETokenizer

    (tmp_path / "vocab.json").write_text(text)
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    return lambda: GPT2BPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))


def _tokenizer_json(tmp_path, text):
    from megalite.data.tokenizer import HuggingFaceTokenizer

    (tmp_path / "tokenizer.json").write_text(text)
    return lambda: HuggingFaceTokenizer(str(tmp_path / "tokenizer.json"))


def _tokenizer_folder(tmp_path, text):
    from megalite.data.tokenizer import HuggingFaceTokenizer

    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(text)
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"}')
    return lambda: HuggingFaceTokenizer(str(folder))


def _preprocess_row(tmp_path, text):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "1 2 3"}\n' + text.replace("\n", " ") + "\n")
    argv = ["--input", str(path), "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "64"]
    return lambda: load_tool("preprocess_data").main(argv)


def _train_tokenizer_row(tmp_path, text):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "hello world"}\n' + text.replace("\n", " ") + "\n")
    argv = ["--input", str(path), "--output-dir", str(tmp_path / "tok"), "--vocab-size", "300"]
    return lambda: load_tool("train_tokenizer").main(argv)


def _megatron_metadata(tmp_path, text):
    from megalite.checkpointing.megatron.torch_dist.reader import DistCheckpoint

    folder = tmp_path / "iter_0000001"
    folder.mkdir()
    (folder / "metadata.json").write_text(text)
    return lambda: DistCheckpoint(str(folder))


def _hf_config(tmp_path, text):
    from megalite.checkpointing.hf.convert import read_hf_config

    (tmp_path / "config.json").write_text(text)
    return lambda: read_hf_config(str(tmp_path))


def _lambada_lines(tmp_path, text):
    from megalite.inference.evaluation import read_lambada

    path = tmp_path / "lambada.jsonl"
    path.write_text('{"text": "a b c"}\n' + text.replace("\n", " ") + "\n")
    return lambda: read_lambada(str(path))


# name -> (reader, a valid document with a key written twice, the same document nested too deeply)
WORD_LEVEL = ('{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null, '
              '"pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null, '
              '"model": {"type": "WordLevel", "vocab": VOCAB, "unk_token": "</s>"}}')


def _word_level(vocab: str) -> str:
    return WORD_LEVEL.replace("VOCAB", vocab)


READERS: dict[str, tuple[Callable, str, str]] = {
    "--config json": (_pretrain_config(".json"), '{"hidden_size": 16,\n "hidden_size": 32}',
                      '{"hidden_size": ' + DEEP + '}'),
    "--config yaml": (_pretrain_config(".yaml"), "hidden_size: 16\nhidden_size: 32\n",
                      "hidden_size: " + DEEP + "\n"),
    "--deepspeed-config": (_deepspeed_config, '{"train_batch_size": 8,\n "train_batch_size": 16}',
                           '{"zero_optimization": ' + DEEP + '}'),
    "--vocab-file": (_vocab_json, '{"a": 0,\n "b": 1,\n "a": 2}', '{"a": ' + DEEP + '}'),
    "--tokenizer-model tokenizer.json": (_tokenizer_json, _word_level('{"a": 0, "</s>": 1, "a": 2}'),
                                         '{"model": ' + DEEP + '}'),
    "--tokenizer-model folder": (_tokenizer_folder, _word_level('{"a": 0, "</s>": 1, "a": 2}'),
                                 '{"model": ' + DEEP + '}'),
    "preprocess_data.py jsonl row": (_preprocess_row, '{"text": "1 2", "text": "3 4"}',
                                     '{"text": "1", "meta": ' + DEEP + '}'),
    "train_tokenizer.py jsonl row": (_train_tokenizer_row, '{"text": "a b", "text": "c d"}',
                                     '{"text": "a", "meta": ' + DEEP + '}'),
    "Megatron metadata.json": (_megatron_metadata, '{"sharded_backend": "zarr",\n "sharded_backend": "torch_dist"}',
                               '{"sharded_backend": "torch_dist", "x": ' + DEEP + '}'),
    "from-hf config.json": (_hf_config, '{"model_type": "gpt2",\n "n_layer": 2,\n "n_layer": 4}',
                            '{"model_type": "gpt2", "x": ' + DEEP + '}'),
    "tasks lambada line": (_lambada_lines, '{"text": "a b", "text": "c d"}', '{"text": "a", "x": ' + DEEP + '}'),
}


@pytest.mark.parametrize("name", list(READERS))
def test_a_key_written_twice_is_refused_by_name(name, tmp_path, capsys):
    read, dup, _ = READERS[name]
    message = _message(read(tmp_path, dup), capsys)
    assert "is written twice" in message, message


@pytest.mark.parametrize("name", list(READERS))
def test_deep_nesting_is_a_named_error(name, tmp_path, capsys):
    read, _, deep = READERS[name]
    message = _message(read(tmp_path, deep), capsys)
    assert "nested deeper than 100 levels" in message, message


def test_the_readers_accept_the_same_documents_without_the_repeat(tmp_path):
    """The refusals above come from the repeat, not from a reader that fails on everything."""
    from megalite.data.tokenizer import HuggingFaceTokenizer

    (tmp_path / "tokenizer.json").write_text(_word_level('{"a": 0, "</s>": 1, "b": 2}'))
    tok = HuggingFaceTokenizer(str(tmp_path / "tokenizer.json"))
    assert tok.tokenize("a b") == [0, 2] and tok.eod == 1


def test_a_tokenizer_json_with_a_token_twice_changed_ids_before(tmp_path):
    """Why the tokenizer reader must refuse: the Rust reader keeps the last id of a token written twice."""
    from tokenizers import Tokenizer

    (tmp_path / "t.json").write_text(_word_level('{"a": 0, "</s>": 1, "a": 2}'))
    assert Tokenizer.from_file(str(tmp_path / "t.json")).encode("a").ids == [2]


def _parquet(path: str, names: list[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table([pa.array(["1 2", "3"]), pa.array(["4 5", "6"])], names=names), path)


@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
def test_a_table_column_named_twice_is_refused(suffix, tmp_path, capsys):
    path = str(tmp_path / f"in{suffix}")
    if suffix == ".parquet":
        _parquet(path, ["text", "text"])
    else:
        import pyarrow as pa

        table = pa.table([pa.array(["1 2"]), pa.array(["3"])], names=["text", "text"])
        with pa.ipc.new_file(path, table.schema) as w:
            w.write_table(table)
    argv = ["--input", path, "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "64"]
    message = _message(lambda: load_tool("preprocess_data").main(argv), capsys)
    assert "column 'text' is in the schema twice" in message, message
    assert not os.path.exists(tmp_path / "out_text_document.bin")


def test_a_safetensors_header_naming_a_tensor_twice_is_refused(tmp_path):
    from megalite.checkpointing.hf.files import safetensors_header

    entry = '{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'
    header = ('{"w": ' + entry + ', "w": ' + entry + "}").encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    with pytest.raises(Exception, match="key 'w' is written twice"):
        safetensors_header(str(path))


BILLION_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi"))


def test_a_yaml_of_nested_aliases_is_refused_not_expanded(tmp_path, capsys):
    assert len(BILLION_LAUGHS) < 1024
    message = _message(_pretrain_config(".yaml")(tmp_path, BILLION_LAUGHS), capsys)
    assert "aliases (*name) expand to more than 100000 values" in message, message


def test_a_yaml_alias_inside_itself_is_refused(tmp_path, capsys):
    message = _message(_pretrain_config(".yaml")(tmp_path, "hidden_size: &a [*a]\n"), capsys)
    assert "nested deeper than 100 levels" in message, message


def test_a_yaml_alias_used_a_few_times_is_read():
    from megalite.config.strict_load import load_yaml

    text = "a: &x [1, 2]\nb: *x\nc: {<<: &m {d: 3}, e: 4}\nf: *m\n"
    assert load_yaml(text, "x.yaml") == {"a": [1, 2], "b": [1, 2], "c": {"d": 3, "e": 4}, "f": {"d": 3}}


def test_the_strict_reader_bounds_are_shared():
    """One reader, one bound: the JSON, JSONL and YAML readers refuse past the same depth."""
    from megalite.config import strict_load as s

    ok = "[" * s.MAX_DEPTH + "]" * s.MAX_DEPTH
    assert s.load_json(ok, "x") is not None and s.load_json_line(ok, "x") is not None
    assert s.load_yaml(ok, "x") is not None
    for reader in (s.load_json, s.load_json_line, s.load_yaml, lambda t, n: s.load_json_with_lines(t, n)):
        with pytest.raises(s.NestingError):
            reader("[" + ok + "]", "x")
