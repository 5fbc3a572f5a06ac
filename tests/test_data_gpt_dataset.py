"""Promises: for the same .bin/.idx, split, sequence length, sample count and seed, megalite's GPT
samples and their order equal megatron-core's; the vectorised index build equals megatron's C++
helper; indices are cached under a hash of their inputs, built once by the builder and reused."""

from __future__ import annotations

import datetime
import os

import numpy as np
import pytest

from megalite.data import DataConfig, build_datasets
from megalite.data import gpt_indices as gi
from megalite.data.mock import MockGPTDataset
from tests.data_fixtures import RefTokenizer, import_mcore, mcore_datasets, random_datasets, scratch_dir


def ours(data_path=None, per_split=None, split="969,30,1", sizes=(100, 20, 10), seq_length=16, seed=1234,
         cache=None, is_builder=True, barrier=None):
    cfg = DataConfig(data_path=data_path, split=split, data_cache_path=cache or scratch_dir("cache"))
    if per_split:
        cfg.train_data_path, cfg.valid_data_path, cfg.test_data_path = per_split
    return build_datasets(cfg, seq_length=seq_length, seed=seed, num_samples=sizes,
                          tokenizer=RefTokenizer(), is_builder=is_builder, barrier=barrier)


def assert_same_samples(ref, got):
    for split, (a, b) in enumerate(zip(ref, got)):
        if a is None or b is None:
            assert a is None and b is None, f"split {split}: {a} vs {b}"
            continue
        assert len(a) == len(b), f"split {split}: megatron {len(a)} samples, megalite {len(b)}"
        for i in range(len(a)):
            text = b[i]["text"]
            assert text.dtype == np.int64
            assert np.array_equal(a[i]["tokens"].numpy(), text[:-1]), f"split {split} sample {i}"
            assert np.array_equal(a[i]["labels"].numpy(), text[1:]), f"split {split} sample {i}"


A, B, C = 0, 1, 2
CASES = {
    "single_one_epoch": dict(data_path=[A], split="80,15,5", sizes=(100, 20, 10)),
    "single_many_epochs": dict(data_path=[A], split="80,15,5", sizes=(1500, 300, 7)),
    "shared_final_epoch": dict(data_path=[A], split="80,15,5", sizes=(401, 30, 7)),
    "separate_final_epoch": dict(data_path=[A], split="80,15,5", sizes=(200, 40, 20)),
    "weighted_blend": dict(data_path=["0.3", A, "0.7", B], split="80,15,5", sizes=(500, 50, 20)),
    "unweighted_blend": dict(data_path=[A, B, C], split="80,15,5", sizes=(300, 50, 20)),
    "per_split_paths": dict(per_split=[[A], ["1", B, "2", C], [C]], sizes=(300, 50, 20)),
    "empty_splits": dict(data_path=[A], split="100,0,0", sizes=(100, 0, 0)),
    "seq_length_64": dict(data_path=[B], split="90,8,2", sizes=(100, 10, 3), seq_length=64, seed=7),
}


def _resolve(case: dict) -> dict:
    prefixes = random_datasets()
    pick = lambda v: prefixes[v] if isinstance(v, int) else v
    out = dict(case)
    if "data_path" in out:
        out["data_path"] = [pick(v) for v in out["data_path"]]
    if "per_split" in out:
        out["per_split"] = [[pick(v) for v in s] for s in out["per_split"]]
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_samples_and_order_match_megatron_core(name):
    case = _resolve(CASES[name])
    ref_kw = dict(case)
    if "data_path" in case:
        ref_kw["split"] = case["split"]
    assert_same_samples(mcore_datasets(**ref_kw), ours(**case))


def test_cases_cover_both_final_epoch_rules():
    """The multi-epoch cases above really exercise the shared and the separate final-epoch shuffle."""
    from megalite.data.indexed_dataset import IndexedDataset

    lengths = IndexedDataset(random_datasets()[A]).sequence_lengths
    docs = np.arange(0, int(round(0.8 * len(lengths))))
    tokens = int(lengths[docs].sum())
    seen = set()
    for n in (CASES["single_many_epochs"]["sizes"][0], CASES["separate_final_epoch"]["sizes"][0],
              CASES["shared_final_epoch"]["sizes"][0]):
        epochs = gi.num_epochs(tokens, n, 16, True)
        seen.add((epochs > 1, gi.separate_final_epoch(tokens, epochs, n, 16, True)))
    assert seen == {(True, False), (True, True)}


def test_sample_index_equals_megatron_helper():
    _, _, helpers, _, _ = import_mcore()
    rng = np.random.default_rng(0)
    for trial in range(150):
        ndoc = int(rng.integers(1, 40))
        sizes = rng.integers(0 if trial % 3 == 0 else 1, 40, size=ndoc).astype(np.int32)
        sizes[0] += 3
        epochs = int(rng.integers(1, 4))
        doc_index = np.tile(np.arange(ndoc, dtype=np.int32), epochs)
        rng.shuffle(doc_index)
        seq = int(rng.integers(2, 30))
        tokens = int(sizes.sum())
        # Keeping a partial last sample needs a non-empty last document (megatron's helper asserts).
        for drop_last in (True, False) if sizes[doc_index[-1]] else (True,):
            for extra in (True, False):
                ref = helpers.build_sample_idx(sizes, doc_index, seq, epochs, tokens, drop_last, extra)
                got = gi.sample_index(sizes, doc_index, seq, epochs, tokens, drop_last, extra)
                assert got.dtype == ref.dtype and np.array_equal(got, ref), (trial, drop_last, extra)


def test_blending_indices_equal_megatron_helper_and_hold_ratios():
    _, _, helpers, _, _ = import_mcore()
    rng = np.random.default_rng(1)
    for _ in range(60):
        n = int(rng.integers(1, 5))
        w = rng.random(n) + 0.01
        w = (w / w.sum()).tolist()
        size = int(rng.integers(0, 3000))
        ref_d, ref_s = np.zeros(size, np.int16), np.zeros(size, np.int64)
        helpers.build_blending_indices(ref_d, ref_s, w, n, size, False)
        got_d, got_s = gi.blending_indices(w, size)
        assert np.array_equal(got_d, ref_d) and np.array_equal(got_s, ref_s)
        counts = np.bincount(got_d, minlength=n)
        assert np.all(np.abs(counts - np.asarray(w) * size) <= 1.0 + 1e-9)


def test_blend_ratio_and_overlapping_samples():
    """A 0.25/0.75 blend draws each dataset in proportion; unshuffled samples overlap by one token."""
    a, b, _ = random_datasets()
    train, _, _ = ours(data_path=["0.25", a, "0.75", b], split="1,0,0", sizes=(400, 0, 0))
    assert len(train) == 400
    counts = np.bincount(np.asarray(train.dataset_index), minlength=2)
    assert counts.tolist() == [100, 300]
    ds = train.datasets[0]
    order = np.argsort(np.asarray(ds.shuffle_index))  # sample at unshuffled position k is order[k]
    for k in range(20):
        cur, nxt = ds[int(order[k])]["text"], ds[int(order[k + 1])]["text"]
        assert len(cur) == 17 and cur[-1] == nxt[0]


def test_cache_is_reused_and_invalidated():
    a, b, _ = random_datasets()
    cache = scratch_dir("cache-reuse")
    first = ours(data_path=[a], split="90,10,0", sizes=(50, 5, 0), cache=cache)
    files = sorted(os.listdir(cache))
    assert len(files) == 10  # 2 splits x (3 arrays + description), and the file's largest token id (+ description)
    mtimes = {f: os.stat(os.path.join(cache, f)).st_mtime_ns for f in files}
    again = ours(data_path=[a], split="90,10,0", sizes=(50, 5, 0), cache=cache)
    assert sorted(os.listdir(cache)) == files
    assert all(os.stat(os.path.join(cache, f)).st_mtime_ns == mtimes[f] for f in files)
    assert np.array_equal(first[0][3]["text"], again[0][3]["text"])
    # Each input that determines the indices makes a new entry.
    changes = [dict(seed=99), dict(seq_length=8), dict(sizes=(60, 5, 0)), dict(split="80,20,0")]
    for change in changes:
        kw = dict(data_path=[a], split="90,10,0", sizes=(50, 5, 0), cache=cache)
        kw.update(change)
        before = set(os.listdir(cache))
        ours(**kw)
        assert len(set(os.listdir(cache)) - before) >= 4, change
    # Same prefix, different contents: the lengths hash changes, so does the entry.
    before = set(os.listdir(cache))
    d = scratch_dir("rewritten")
    from tests.data_fixtures import random_indexed
    random_indexed(os.path.join(d, "x"), 90, seed=123)
    ours(data_path=[os.path.join(d, "x")], split="90,10,0", sizes=(50, 5, 0), cache=cache)
    assert len(set(os.listdir(cache)) - before) == 10


def test_builder_writes_then_others_load_after_barrier():
    a, b, _ = random_datasets()
    cache = scratch_dir("cache-ranks")
    events = []
    kw = dict(data_path=["0.5", a, "0.5", b], split="90,10,0", sizes=(80, 8, 0), cache=cache)
    with pytest.raises(FileNotFoundError, match="builder rank"):
        ours(**kw, is_builder=False)  # a non-builder never builds
    assert os.listdir(cache) == []
    built = ours(**kw, is_builder=True, barrier=lambda: events.append(sorted(os.listdir(cache))))
    assert events and any(f.endswith("dataset_index.npy") for f in events[0])  # written before the barrier
    loaded = ours(**kw, is_builder=False, barrier=lambda: events.append("barrier"))
    for x, y in zip(built, loaded):
        if x is not None:
            assert len(x) == len(y) and all(np.array_equal(x[i]["text"], y[i]["text"]) for i in range(len(x)))


def test_dataset_pickles_without_copying_indices():
    import pickle

    a, _, _ = random_datasets()
    train, _, _ = ours(data_path=[a], sizes=(40, 0, 0))
    clone = pickle.loads(pickle.dumps(train))
    assert len(pickle.dumps(train)) < 4096
    assert np.array_equal(clone[5]["text"], train[5]["text"])


def test_zero_samples_or_documents_give_none_and_mock_data():
    a, _, _ = random_datasets()
    assert ours(data_path=[a], split="100,0,0", sizes=(10, 5, 5))[1:] == (None, None)
    assert ours(data_path=[a], split="99,1,0", sizes=(10, 0, 3))[1:] == (None, None)
    # 90 documents: "995,4,1" rounds the valid and test ranges to no documents (megatron-core would loop).
    assert ours(data_path=[a], split="995,4,1", sizes=(10, 5, 5))[1:] == (None, None)
    cfg = DataConfig(mock_data=True)
    train, valid, test = build_datasets(cfg, seq_length=8, seed=3, num_samples=(10, 4, 0),
                                        tokenizer=RefTokenizer(50), is_builder=True, barrier=None)
    assert isinstance(train, MockGPTDataset) and len(train) == 10 and len(valid) == 4 and test is None
    assert train[0]["text"].shape == (9,) and train[0]["text"].max() < 50
    assert not np.array_equal(train[0]["text"], valid[0]["text"])


def test_bad_data_flags_name_the_problem():
    a, _, _ = random_datasets()
    with pytest.raises(ValueError, match="--data-path"):
        build_datasets(DataConfig(), seq_length=8, seed=1, num_samples=(1, 1, 1), tokenizer=RefTokenizer(),
                       is_builder=True, barrier=None)
    with pytest.raises(ValueError, match="not both"):
        ours(data_path=[a], per_split=[[a], None, None])
    with pytest.raises(FileNotFoundError, match="missing_prefix.idx"):
        ours(data_path=[a + "missing_prefix"])
    with pytest.raises(ValueError, match="weight"):
        ours(data_path=["0.5", a, a, "0.5"])
    with pytest.raises(ValueError, match="must be a finite number > 0"):
        ours(data_path=["0", a, "1", a])
    with pytest.raises(ValueError, match="--split"):
        ours(data_path=[a], split="1,2,3,4")
    with pytest.raises(PermissionError, match="--data-cache-path"):
        ours(data_path=[a], cache="/proc/megalite-no-such-dir")


def _rank_main(rank: int, world: int, port: int, cache: str, data_path: list[str], out) -> None:
    import torch.distributed as dist

    import megalite.data.gpt_indices as indices

    try:
        if rank != 0:  # a non-builder must never compute indices
            def forbidden(*a, **k):
                raise AssertionError("non-builder rank built indices")
            indices.build_gpt_indices = forbidden
            indices.blending_indices = forbidden
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        datasets = ours(data_path=data_path, split="90,10,0", sizes=(64, 8, 0), cache=cache,
                        is_builder=rank == 0, barrier=dist.barrier)
        samples = [None if d is None else [d[i]["text"].tolist() for i in range(len(d))] for d in datasets]
        out.put((rank, samples))
        dist.destroy_process_group()
    except BaseException as e:  # report instead of hanging the parent
        out.put((rank, repr(e)))


def test_two_ranks_with_a_real_barrier_share_one_build():
    import multiprocessing
    import socket

    a, b, _ = random_datasets()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    cache = scratch_dir("cache-dist")
    blend = ["0.4", a, "0.6", b]
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, cache, blend, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert all(isinstance(v, list) for v in results.values()), results
    assert results[0] == results[1]
