"""Attention cores below the model: document boundaries of packed sequences (``documents``), causal attention
of whole sequences inside them (``core``) and the blockwise kernels with a log-sum-exp that context
parallelism merges (``blocks``). See docs/parallelism.md, "Packed documents"."""

from megalite.attention.core import UNFUSED_BACKENDS, core_attention
from megalite.attention.documents import Chunk, Documents, Piece, chunk_pieces

__all__ = ["UNFUSED_BACKENDS", "Chunk", "Documents", "Piece", "chunk_pieces", "core_attention"]
