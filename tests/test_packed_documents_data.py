"""Promises of the packed-document flags' data side (docs/data.md, "Packed documents"):
- on a real --append-eod corpus, every sample's loss mask and position ids equal megatron-core's
  (``GPTDataset`` with --eod-mask-loss / --reset-position-ids, i.e. ``_get_ltor_masks_and_position_ids``), and
  the micro-batch's ``cu_seqlens`` are exactly the document blocks of megatron-core's dense attention mask;
- the micro-batch contract (keys, dtypes, shapes, the EOD-at-the-end rule) on a hand-made batch; without
  the flags the micro-batch and the mock's token stream are what they always were;
- --dataloader-inter-document-masking takes the boundaries from the document index, through blends and the
  cached (or pickled) indices; the mock's documents end in EOD;
- the flags parse from the command line and a --config file, and the invalid combinations are refused by name;
- one warning, on rank 0, when the flags meet a corpus where a bounded look finds no EOD;
- the model reads per-sample position ids [b, s]."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from megalite.config import parse_args, validate
from megalite.data import DataConfig, build_datasets
from megalite.data.documents import DocumentMasking, cu_seqlens, eod_starts, position_ids
from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from megalite.data.mock import MockGPTDataset
from megalite.data.tokenizer import GPT2BPETokenizer
from megalite.parallel.groups import ProcessGroups
from megalite.training.batches import build_run_data, make_microbatch
from tests.data_fixtures import RefTokenizer, eod_corpus, mcore_datasets, random_datasets, scratch_dir, tiny_bpe

CPU = torch.device("cpu")
SEQ = 32
ALL_EOD_FLAGS = dict(eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)


def bpe() -> GPT2BPETokenizer:
    t = tiny_bpe()
    return GPT2BPETokenizer(t["vocab_file"], t["merge_file"])


def masking(eod: int, **flags) -> DocumentMasking:
    return DocumentMasking.of(DataConfig(mock_data=True, vocab_size=8, **flags), eod)


def ours(data_path, tokenizer, sizes, seq_length=SEQ, split="90,8,2", cache=None, is_builder=True, **flags):
    cfg = DataConfig(data_path=data_path, split=split, data_cache_path=cache or scratch_dir("cache"), **flags)
    return build_datasets(cfg, seq_length=seq_length, seed=1234, num_samples=sizes, tokenizer=tokenizer,
                          is_builder=is_builder, barrier=None)


def starts_of_dense_mask(mask: torch.Tensor) -> list[int]:
    """Where a document starts in megatron-core's dense mask (True = masked): position 0, and each j whose
    query may not see j - 1; checking that the mask is exactly block-diagonal causal over those blocks."""
    m = mask[0]
    s = m.shape[0]
    starts = [0] + [j for j in range(1, s) if m[j, j - 1]]
    doc = np.searchsorted(np.asarray(starts), np.arange(s), side="right")
    allowed = np.tril(np.ones((s, s), dtype=bool)) & (doc[:, None] == doc[None, :])
    assert np.array_equal(~m.numpy(), allowed), "megatron's mask is not block-diagonal causal"
    return starts


# ---- against megatron-core, on a real corpus --------------------------------------------------------------


@pytest.fixture(scope="module")
def real():
    """megalite's and megatron-core's train split of the EOD corpus, 3000 samples of 32 tokens, all flags."""
    tok = bpe()
    prefix = eod_corpus()
    ref = mcore_datasets(data_path=[prefix], split="90,8,2", sizes=(3000, 0, 0), seq_length=SEQ,
                         tokenizer=RefTokenizer(tok.vocab_size, tok.eod), **ALL_EOD_FLAGS)[0]
    got = ours([prefix], tok, (3000, 0, 0), **ALL_EOD_FLAGS)[0]
    return tok, ref, got


def test_loss_mask_and_position_ids_equal_megatron_core_on_a_real_corpus(real):
    tok, ref, got = real
    rule = masking(tok.eod, **ALL_EOD_FLAGS)
    assert len(ref) == len(got) >= 3000
    eods = 0
    for i in range(len(got)):
        mb = make_microbatch(got, [i], CPU, rule)
        want = ref[i]
        assert torch.equal(mb["tokens"][0], want["tokens"]), i
        assert torch.equal(mb["loss_mask"][0], want["loss_mask"]), i
        assert torch.equal(mb["position_ids"][0], want["position_ids"]), i
        eods += int((want["tokens"] == tok.eod).sum())
    assert eods > 500, "the corpus must put EODs inside the samples"


def test_boundaries_are_megatron_cores_dense_mask_blocks(real):
    tok, ref, got = real
    rule = masking(tok.eod, **ALL_EOD_FLAGS)
    b, n_eod_last = 4, 0
    for first in range(0, 3000, b):
        idx = list(range(first, first + b))
        mb = make_microbatch(got, idx, CPU, rule)
        want = [r * SEQ + j for r, i in enumerate(idx) for j in starts_of_dense_mask(ref[i]["attention_mask"])]
        cu = mb["cu_seqlens"]
        assert cu.dtype == torch.int32 and cu.tolist() == want + [b * SEQ]
        assert mb["max_seqlen"] == int(torch.diff(cu).max()) and isinstance(mb["max_seqlen"], int)
        n_eod_last += int((mb["tokens"][:, -1] == tok.eod).sum())
    assert n_eod_last > 0, "an EOD at the last input position (no boundary) must occur"


# ---- the contract -------------------------------------------------------------------------------------------


class Rows:
    """A dataset of given rows (seq_length + 1 tokens each)."""

    def __init__(self, rows, starts=None):
        self.rows, self.starts = [np.asarray(r, dtype=np.int64) for r in rows], starts

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"text": self.rows[i]}

    def document_starts(self, i):
        return np.asarray(self.starts[i])


def test_contract_on_a_hand_made_batch():
    """EOD = 9, s = 6: sample 0 has EODs at 1 and 4, sample 1 at 0 and at the last input position 5."""
    data = Rows([[1, 9, 2, 3, 9, 4, 5], [9, 1, 1, 1, 1, 9, 7]])
    mb = make_microbatch(data, [0, 1], CPU, masking(9, **ALL_EOD_FLAGS))
    assert set(mb) == {"tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "max_seqlen"}
    assert mb["tokens"].dtype == mb["labels"].dtype == mb["position_ids"].dtype == torch.int64
    assert mb["loss_mask"].dtype == torch.float32 and mb["cu_seqlens"].dtype == torch.int32
    assert mb["tokens"].tolist() == [[1, 9, 2, 3, 9, 4], [9, 1, 1, 1, 1, 9]]
    assert mb["labels"].tolist() == [[9, 2, 3, 9, 4, 5], [1, 1, 1, 1, 9, 7]]
    assert mb["loss_mask"].tolist() == [[1, 0, 1, 1, 0, 1], [0, 1, 1, 1, 1, 0]]
    assert mb["position_ids"].tolist() == [[0, 1, 0, 1, 2, 0], [0, 0, 1, 2, 3, 4]]
    assert mb["cu_seqlens"].tolist() == [0, 2, 5, 6, 7, 12]  # no boundary for the EOD at 5: 12 ends it
    assert mb["max_seqlen"] == 5
    only_mask = make_microbatch(data, [0, 1], CPU, masking(9, eod_mask_loss=True))
    assert set(only_mask) == {"tokens", "labels", "loss_mask"}
    only_positions = make_microbatch(data, [0, 1], CPU, masking(9, reset_position_ids=True))
    assert set(only_positions) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert only_positions["loss_mask"].eq(1).all()  # the resets alone mask nothing
    only_boundaries = make_microbatch(data, [0, 1], CPU, masking(9, reset_attention_mask=True))
    assert set(only_boundaries) == {"tokens", "labels", "loss_mask", "cu_seqlens", "max_seqlen"}


def test_pad_labels_get_no_loss_as_in_megatron_core():
    rule = DocumentMasking(eod=9, pad=7)
    fields = rule.fields(np.array([[1, 2, 3]]), np.array([[2, 7, 4]]))
    assert fields["loss_mask"].tolist() == [[1, 0, 1]]


def test_without_the_flags_the_micro_batch_and_the_mock_stream_are_unchanged():
    mock = MockGPTDataset(4, 16, 64, seed=3)
    for i in range(4):  # the progression the golden curves were trained on
        rng = np.random.default_rng([3, i])
        start, stride = int(rng.integers(0, 64)), MockGPTDataset.STRIDES[int(rng.integers(0, 5))]
        assert np.array_equal(mock[i]["text"], (start + stride * np.arange(17)) % 64)
    mb = make_microbatch(mock, [0, 1], CPU)
    assert set(mb) == {"tokens", "labels", "loss_mask"} and mb["loss_mask"].eq(1).all()
    assert DocumentMasking.of(DataConfig(mock_data=True, vocab_size=8), 7) is None


def test_inter_document_boundaries_come_from_the_dataset_and_replace_the_eods():
    data = Rows([[1, 9, 2, 3, 9, 4, 5], [9, 1, 1, 1, 1, 9, 7]], starts=[[3], []])
    mb = make_microbatch(data, [0, 1], CPU, masking(9, dataloader_inter_document_masking=True, eod_mask_loss=True))
    assert mb["cu_seqlens"].tolist() == [0, 3, 6, 12]
    assert mb["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]]
    assert mb["loss_mask"].tolist() == [[1, 0, 1, 1, 0, 1], [0, 1, 1, 1, 1, 0]]  # --eod-mask-loss: still EODs


# ---- inter-document masking on real index files, blends, the cache -------------------------------------------


def arange_corpus(prefix: str, num_docs: int, seed: int) -> str:
    """Documents 0, 1, ..., n-1 (no EOD): inside a sample a new document starts exactly where a token is 0."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(num_docs):
            w.add_document(np.arange(int(rng.integers(1, 50))))
        w.finalize()
    return prefix


@pytest.fixture(scope="module")
def arange_prefixes() -> list[str]:
    d = scratch_dir("arange")
    return [arange_corpus(f"{d}/a", 300, 0), arange_corpus(f"{d}/b", 200, 1)]


def oracle_starts(tokens: np.ndarray) -> np.ndarray:
    starts = tokens == 0
    starts[:, 0] = True
    return starts


@pytest.mark.parametrize("blend", [False, True])
def test_inter_document_boundaries_equal_the_document_index(arange_prefixes, blend):
    path = ["0.6", arange_prefixes[0], "0.4", arange_prefixes[1]] if blend else [arange_prefixes[0]]
    cache = scratch_dir("inter-doc-cache")
    flags = dict(dataloader_inter_document_masking=True)
    train = ours(path, RefTokenizer(), (2000, 0, 0), cache=cache, **flags)[0]
    rule = masking(1000, **flags)
    for first in range(0, 2000, 5):
        mb = make_microbatch(train, list(range(first, first + 5)), CPU, rule)
        starts = oracle_starts(mb["tokens"].numpy())
        assert mb["cu_seqlens"].tolist() == cu_seqlens(starts).tolist()
        assert np.array_equal(mb["position_ids"].numpy(), position_ids(starts))
    reloaded = ours(path, RefTokenizer(), (2000, 0, 0), cache=cache, is_builder=False, **flags)[0]  # from the cache
    copied = pickle.loads(pickle.dumps(train))
    for other in (reloaded, copied):
        for i in range(0, 2000, 97):
            assert np.array_equal(other.document_starts(i), train.document_starts(i))


def test_eod_flags_through_a_blend_and_the_cache(arange_prefixes):
    tok = bpe()
    path, cache = ["0.5", eod_corpus(), "0.5", arange_prefixes[0]], scratch_dir("blend-cache")
    built = ours(path, tok, (600, 0, 0), cache=cache, **ALL_EOD_FLAGS)[0]
    loaded = ours(path, tok, (600, 0, 0), cache=cache, is_builder=False, **ALL_EOD_FLAGS)[0]
    rule = masking(tok.eod, **ALL_EOD_FLAGS)
    for first in range(0, 600, 4):
        idx = list(range(first, first + 4))
        a, b = make_microbatch(built, idx, CPU, rule), make_microbatch(loaded, idx, CPU, rule)
        starts = eod_starts(a["tokens"].numpy(), tok.eod)
        assert a["cu_seqlens"].tolist() == b["cu_seqlens"].tolist() == cu_seqlens(starts).tolist()
        assert torch.equal(a["position_ids"], b["position_ids"])


def test_mock_documents_end_in_eod_when_a_flag_is_on():
    cfg = DataConfig(mock_data=True, vocab_size=63, eod_mask_loss=True)
    tok = RefTokenizer(64)  # eod 63, as NullTokenizer(63)
    train = build_datasets(cfg, seq_length=SEQ, seed=5, num_samples=(50, 0, 0), tokenizer=tok, is_builder=True,
                           barrier=None)[0]
    rule = masking(63, dataloader_inter_document_masking=True)
    eods = 0
    for i in range(50):
        text = train[i]["text"]
        assert text.max() < 64 and text.dtype == np.int64
        docs = np.split(text, np.flatnonzero(text == 63) + 1)
        assert all(len(d) >= 2 for d in docs[:-1])  # a progression of at least one token, then EOD
        eods += len(docs) - 1
        mb = make_microbatch(train, [i], CPU, rule)  # the mock's document index is its EODs
        assert mb["cu_seqlens"].tolist() == cu_seqlens(eod_starts(text[None, :-1], 63)).tolist()
    assert eods > 100


# ---- flags, rules, warning -----------------------------------------------------------------------------------


BASE = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16"]


def test_flags_parse_from_the_command_line_and_a_config_file(tmp_path, capsys):
    cfg = parse_args(BASE)
    assert not (cfg.data.eod_mask_loss or cfg.data.reset_position_ids or cfg.data.reset_attention_mask
                or cfg.data.dataloader_inter_document_masking or cfg.training.calculate_per_token_loss)
    cfg = parse_args(BASE + ["--eod-mask-loss", "--reset-position-ids", "--reset-attention-mask",
                             "--dataloader-inter-document-masking", "--calculate-per-token-loss",
                             "--no-create-attention-mask-in-dataloader"])
    assert cfg.data.packs_documents and cfg.data.dataloader_inter_document_masking
    assert cfg.training.calculate_per_token_loss
    err = capsys.readouterr().err
    assert "--no-create-attention-mask-in-dataloader" in err and "cu_seqlens" in err  # ignored, and why
    (tmp_path / "c.yaml").write_text("data:\n  reset_position_ids: true\ntraining:\n  calculate_per_token_loss: true\n")
    cfg = parse_args(BASE + ["--config", str(tmp_path / "c.yaml")])
    assert cfg.data.reset_position_ids and cfg.training.calculate_per_token_loss
    assert cfg.to_dict()["data"]["reset_position_ids"] is True


def test_context_parallel_takes_every_flag():
    """The CP split carries the position ids and the whole sequences' boundaries (the layouts against serial:
    tests/test_packed_training.py)."""
    for flags in (["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"],
                  ["--dataloader-inter-document-masking"]):
        validate(parse_args(BASE + ["--context-parallel-size", "2", *flags]), 2)


def write_sequences(prefix: str, eod_at: dict[int, int], every_end: bool = False) -> IndexedDataset:
    """4000 sequences of 30 tokens of 5; ``eod_at``: sequence -> position of a 7; ``every_end``: each ends in 7."""
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for k in range(4000):
            seq = np.full(30, 5)
            if k in eod_at:
                seq[eod_at[k]] = 7
            if every_end:
                seq[-1] = 7
            w.add_document(seq)
        w.finalize()
    return IndexedDataset(prefix)


def test_has_token_looks_at_sequence_ends_and_the_head_only(tmp_path):
    assert not write_sequences(str(tmp_path / "none"), {}).has_token(7)
    assert write_sequences(str(tmp_path / "ends"), {}, every_end=True).has_token(7)
    assert write_sequences(str(tmp_path / "head"), {10: 15}).has_token(7)  # within the first 65536 tokens
    assert not write_sequences(str(tmp_path / "buried"), {3000: 15}).has_token(7)  # bounded: not a scan


@pytest.mark.parametrize("flags,warned", [({}, False), (dict(eod_mask_loss=True), True),
                                          (dict(dataloader_inter_document_masking=True), False)])
def test_one_warning_when_the_corpus_has_no_eod(capsys, flags, warned):
    """The random datasets hold ids 0..999 and the NullTokenizer's EOD is 1000: the flags do nothing there."""
    cfg = parse_args(["--data-path", *random_datasets()[:2], "--tokenizer-type", "NullTokenizer", "--vocab-size",
                      "1000", "--split", "90,10,0", "--data-cache-path", scratch_dir("warn"), "--train-iters", "2",
                      "--eval-iters", "1", "--eval-interval", "1", "--global-batch-size", "2", "--seq-length", "16",
                      "--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "2",
                      *[f"--{k.replace('_', '-')}" for k in flags]])
    validate(cfg, 1)
    build_run_data(cfg, ProcessGroups.single())
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "no EOD token" in ln]
    assert len(lines) == (1 if warned else 0)
    if warned:
        assert "--eod-mask-loss" in lines[0] and random_datasets()[0] in lines[0] and random_datasets()[1] in lines[0]


def test_no_warning_on_a_corpus_with_eods(capsys):
    t = tiny_bpe()
    cfg = parse_args(["--data-path", eod_corpus(), "--vocab-file", t["vocab_file"], "--merge-file", t["merge_file"],
                      "--split", "90,10,0", "--data-cache-path", scratch_dir("nowarn"), "--train-iters", "2",
                      "--global-batch-size", "2", "--seq-length", "16", "--num-layers", "1", "--hidden-size", "8",
                      "--num-attention-heads", "2", "--eod-mask-loss", "--reset-position-ids"])
    validate(cfg, 1)
    build_run_data(cfg, ProcessGroups.single())
    assert "no EOD token" not in capsys.readouterr().err


# ---- the model reads per-sample position ids ----------------------------------------------------------------


@pytest.mark.parametrize("position_type", ["learned_absolute", "rope"])
def test_model_reads_per_sample_position_ids(position_type):
    from megalite.config.model import ModelConfig
    from tests.tp_utils import GPT2, build

    cfg = ModelConfig(**{**GPT2, "position_embedding_type": position_type})
    model = build(cfg, ProcessGroups.single(), 64).eval()
    tokens = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.from_numpy(position_ids(eod_starts(np.array([[0] * 16, [1] * 5 + [9] + [1] * 10,
                                                                     [9] * 16]), 9)))
    with torch.no_grad():
        batched = model(tokens, labels=tokens, position_ids=positions)
        for r in range(3):
            alone = model(tokens[r:r + 1], labels=tokens[r:r + 1], position_ids=positions[r])
            assert torch.allclose(batched[r], alone[0], rtol=1e-5, atol=1e-6)
        assert torch.allclose(model(tokens, labels=tokens, position_ids=torch.arange(16).expand(3, 16)),
                              model(tokens, labels=tokens), rtol=1e-5, atol=1e-6)
