"""Sizes read from input are checked against a bound before anything of that size is allocated, in the
tools and readers too (not only pretrain_gpt.py's memory check): a layout string's nested repeats, a
torch_dist ``.metadata`` claiming a huge tensor, an export's vocabulary padded to a huge TP, and a truncated
dataset index cache (.npy), which the builder rebuilds and any other rank names."""

from __future__ import annotations

import os
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest

from tests.data_fixtures import RefTokenizer, random_indexed, scratch_dir


def _peak_bytes(fn) -> tuple[int, BaseException | None]:
    tracemalloc.start()
    try:
        fn()
        error = None
    except Exception as e:  # noqa: BLE001 - returned for the caller to check
        error = e
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak, error


@pytest.mark.parametrize("layout", ["E|((tttttttttt)*99999)*50|L", "E|((t)*99999)*99999|L",
                                    "E|(((t)*1000)*1000)*1000|L"])
def test_a_layout_string_is_measured_before_it_is_expanded(layout):
    from megalite.parallel.stage_layout import parse_layout

    peak, error = _peak_bytes(lambda: parse_layout(layout))
    assert isinstance(error, ValueError) and "expands past 1000000 symbols" in str(error), error
    assert peak < 8 * 2**20, f"{peak} bytes allocated before the layout was refused"


def test_a_torch_dist_index_claiming_a_huge_tensor_is_named_before_allocation(tmp_path):
    from megalite.checkpointing.errors import CheckpointError
    from megalite.checkpointing.megatron.torch_dist.reader import DistCheckpoint

    (tmp_path / "__0_0.distcp").write_bytes(b"\0" * 4096)
    ck = DistCheckpoint.__new__(DistCheckpoint)
    ck.folder, ck._data_bytes = str(tmp_path), None
    huge = (2**20, 2**20)
    md = SimpleNamespace(size=huge, properties=None, chunks=[SimpleNamespace(offsets=(0, 0), sizes=huge)])
    ck._tensors = {"embedding": md}
    peak, error = _peak_bytes(lambda: ck.tensor("embedding"))
    assert isinstance(error, CheckpointError), error
    assert "more than the checkpoint's data files (4096 bytes) hold" in str(error)
    assert peak < 2**20
    md.chunks = [SimpleNamespace(offsets=(0, 0), sizes=(1, 1))]
    with pytest.raises(CheckpointError, match="its chunks hold 1 elements"):
        ck.tensor("embedding")


@pytest.mark.parametrize("tp, padded", [(2**20, None), (1, 2**40)])
def test_an_export_padding_the_vocabulary_past_memory_is_named(tp, padded):
    from megalite.checkpointing.errors import CheckpointError
    from megalite.checkpointing.megatron.export import export_vocab

    config = {"vocab_size": 50257, "hidden_size": 4096, "num_layers": 2, "num_attention_heads": 32}
    with pytest.raises(CheckpointError, match="embedding rows: x hidden 4096"):
        export_vocab(config, padded, tp)
    assert export_vocab(config, None, 8) == 51200


def _datasets(cache: str, prefix: str, is_builder: bool):
    from megalite.config.data import DataConfig
    from megalite.data import build_datasets

    cfg = DataConfig(data_path=[prefix], split="90,10,0", data_cache_path=cache)
    return build_datasets(cfg, seq_length=16, seed=1, num_samples=(50, 5, 0), tokenizer=RefTokenizer(),
                          is_builder=is_builder, barrier=None)


def _truncate_one(cache: str) -> str:
    name = sorted(f for f in os.listdir(cache) if f.endswith("-sample_index.npy"))[0]
    path = os.path.join(cache, name)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 8)
    return path


def test_a_truncated_index_cache_is_named_on_a_loading_rank_and_rebuilt_by_the_builder(capsys):
    from megalite.data.errors import CorruptCacheError

    d, cache = scratch_dir("trunc-data"), scratch_dir("trunc-cache")
    prefix = os.path.join(d, "corpus")
    random_indexed(prefix, 40, seed=0, max_len=30, vocab=1000)
    first = _datasets(cache, prefix, True)
    expected = [np.asarray(first[0][i]["text"]).tolist() for i in range(5)]
    path = _truncate_one(cache)
    with pytest.raises(CorruptCacheError, match="truncated or damaged.*delete it") as e:
        _datasets(cache, prefix, False)
    assert path in str(e.value)
    again = _datasets(cache, prefix, True)
    assert "rebuilding it" in capsys.readouterr().err
    assert [np.asarray(again[0][i]["text"]).tolist() for i in range(5)] == expected


def test_an_index_cache_header_claiming_a_huge_array_is_named(tmp_path):
    from megalite.data.errors import CorruptCacheError
    from megalite.data.index_cache import _map_checked

    path = tmp_path / "x.npy"
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<i8", "fortran_order": False, "shape": (10**12,)})
        f.write(b"\0" * 32)
    with pytest.raises(CorruptCacheError, match="its header says"):
        _map_checked(str(path))
