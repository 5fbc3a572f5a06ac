"""The index arithmetic of a GPT dataset, as pure numpy functions.

Given the sequence lengths of a dataset and the documents of one split, three arrays define every
sample and its order (Megatron-core's ``GPTDataset`` semantics, reproduced exactly so that the same
files, split, sequence length, sample count and seed give the same samples in the same order):

* document index: the split's documents tiled over the epochs and shuffled (int32);
* sample index: for each sample boundary, ``(position in the document index, token offset)``; sample
  ``i`` is the ``seq_length + 1`` tokens starting at boundary ``i``, so consecutive samples overlap by
  one token (the last input token of a sample is the first of the next);
* shuffle index: a permutation of the samples.

Megatron builds the sample index with a sequential C++ walk over the documents. Here it is a few
whole-array numpy passes: boundary ``i`` sits at global token ``i * seq_length`` of the concatenated
epoch stream, and the document holding it is the first whose cumulative end passes it; counting the
boundaries each document holds (from its cumulative end) and repeating the document numbers by those
counts lists every boundary's document in order.
"""

from __future__ import annotations

import math

import numpy as np

from megalite.data.errors import DataError

# A final epoch that would contribute fewer than this fraction of an epoch's samples is shuffled on its
# own, so that its few samples come from all documents rather than the first ones of a global shuffle.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


def num_epochs(tokens_per_epoch: int, num_samples: int | None, seq_length: int, add_extra_token: bool) -> int:
    """Smallest number of epochs holding ``num_samples`` samples (1 when ``num_samples`` is None)."""
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + int(add_extra_token)
    return max(1, -(-needed // tokens_per_epoch))


def samples_before_final_epoch(tokens_per_epoch: int, epochs: int, seq_length: int,
                               add_extra_token: bool) -> int:
    return ((epochs - 1) * tokens_per_epoch - int(add_extra_token)) // seq_length


def separate_final_epoch(tokens_per_epoch: int, epochs: int, num_samples: int | None, seq_length: int,
                         add_extra_token: bool) -> bool:
    """Whether the last epoch is shuffled separately (it is needed only for a small tail of samples)."""
    if epochs == 1 or num_samples is None:
        return False
    before = samples_before_final_epoch(tokens_per_epoch, epochs, seq_length, add_extra_token)
    from_final = num_samples - before
    per_epoch = (tokens_per_epoch - int(add_extra_token)) // seq_length
    if not 0 <= from_final <= per_epoch + 1:
        raise AssertionError(f"inconsistent epoch arithmetic: {from_final} samples from the final epoch, "
                             f"{per_epoch} per epoch")
    return from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)


def document_index(documents: np.ndarray, epochs: int, rng: np.random.RandomState,
                   separate_final: bool) -> np.ndarray:
    """``documents`` repeated ``epochs`` times and shuffled; with ``separate_final`` the first
    ``epochs - 1`` copies are shuffled together and the last copy on its own (same RNG stream)."""
    if not separate_final or epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int32), epochs)
        rng.shuffle(index)
        return index
    first = document_index(documents, epochs - 1, rng, False)
    last = document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def sample_index(sequence_lengths: np.ndarray, doc_index: np.ndarray, seq_length: int, epochs: int,
                 tokens_per_epoch: int, drop_last_partial: bool = True,
                 add_extra_token: bool = True) -> np.ndarray:
    """``[num_samples + 1, 2]`` array of sample boundaries ``(doc_index position, offset)``.

    Equal, element for element and in dtype, to Megatron-core's C++ ``build_sample_idx``.
    """
    extra = int(add_extra_token)
    total = epochs * tokens_per_epoch - extra
    if drop_last_partial:
        n = total // seq_length
    else:  # the C++ helper rounds up in single precision; keep its answer
        n = int(math.ceil(np.float32(np.float32(total) / np.float32(seq_length))))
    big = max(len(doc_index), int(sequence_lengths.max())) > np.iinfo(np.int32).max
    dtype = np.int64 if big else np.int32

    lens = np.asarray(sequence_lengths)[doc_index].astype(np.int64)
    ends = np.cumsum(lens)  # token position (exclusive) where each doc_index entry ends
    # Boundary i sits at token q = i * seq_length and belongs to the first entry with ends >= q + extra
    # (the sample before it ends with token q - 1 + extra). Entry k thus holds the boundaries with
    # ends[k-1] < i * seq_length + extra <= ends[k]; counting them per entry and repeating the entry
    # numbers gives every boundary's entry in one O(entries + samples) pass, already in order.
    upto = np.where(ends >= extra, (ends - extra) // seq_length + 1, 0)  # boundaries i >= 0 so far
    pos = np.repeat(np.arange(len(doc_index), dtype=np.int64), np.diff(upto, prepend=0))[1:n + 1]
    if len(pos) < n:  # only when a partial last sample is kept: the walk stops in the last entry
        pos = np.concatenate((pos, np.full(n - len(pos), len(doc_index), dtype=np.int64)))
    past = pos >= len(doc_index)
    pos = np.minimum(pos, len(doc_index) - 1)
    offsets = np.arange(1, n + 1, dtype=np.int64) * seq_length - (ends[pos] - lens[pos])
    if past.any():
        offsets[past] = lens[-1] - extra
    out = np.empty((n + 1, 2), dtype=dtype)
    out[0] = 0
    out[1:, 0] = pos
    out[1:, 1] = offsets
    return out


def shuffle_index(num_first: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """Permutation of ``range(total)`` that shuffles ``[0, num_first)`` and ``[num_first, total)``
    separately (the second range is the separately shuffled final epoch)."""
    dtype = np.int64 if total >= np.iinfo(np.uint32).max - 1 else np.uint32
    first = np.arange(num_first, dtype=dtype)
    rng.shuffle(first)
    if num_first == total:
        return first
    last = np.arange(num_first, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(sequence_lengths: np.ndarray, documents: np.ndarray, num_samples: int | None,
                      seq_length: int, seed: int, add_extra_token: bool = True,
                      drop_last_partial: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Document, sample and shuffle index of one split (``documents`` are sequence ids)."""
    tokens_per_epoch = int(np.asarray(sequence_lengths)[documents].sum(dtype=np.int64))
    if tokens_per_epoch <= int(add_extra_token):
        raise DataError(f"the split holds {tokens_per_epoch} tokens; a sample needs more than "
                         f"{int(add_extra_token)}")
    epochs = num_epochs(tokens_per_epoch, num_samples, seq_length, add_extra_token)
    separate = separate_final_epoch(tokens_per_epoch, epochs, num_samples, seq_length, add_extra_token)
    rng = np.random.RandomState(seed)
    doc_idx = document_index(documents, epochs, rng, separate)
    sample_idx = sample_index(sequence_lengths, doc_idx, seq_length, epochs, tokens_per_epoch,
                              drop_last_partial, add_extra_token)
    total = len(sample_idx) - 1
    first = samples_before_final_epoch(tokens_per_epoch, epochs, seq_length, add_extra_token) \
        if separate else total
    return doc_idx, sample_idx, shuffle_index(first, total, rng)


def blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """For each of ``size`` blended samples: which dataset, and which of its samples.

    Each step takes the dataset furthest behind its target share (``weight * step - taken``, first one
    on ties), Megatron's rule, computed in the same double-precision order so the result is identical.
    """
    w = [float(x) for x in weights]
    taken = [0] * len(w)
    which = [0] * size
    nth = [0] * size
    ndatasets = len(w)
    for step in range(size):
        t = float(step) if step > 1 else 1.0
        best, best_err = 0, w[0] * t - taken[0]
        for d in range(1, ndatasets):
            err = w[d] * t - taken[d]
            if err > best_err:
                best, best_err = d, err
        which[step] = best
        nth[step] = taken[best]
        taken[best] += 1
    return np.array(which, dtype=np.int16), np.array(nth, dtype=np.int64)
