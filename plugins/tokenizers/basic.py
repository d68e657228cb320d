"""Built-in tokenizers: hashed words and raw UTF-8 bytes.

Both follow :class:`clipkit.contract.types.Tokenizer`: ``tokenizer(texts) -> [B, context_length]`` long
ids laid out as ``[1 (start), t1, ..., tk, 2 (end), 0 (pad), ...]``, truncating the text so the
end token always fits (text encoders pool at the end token). Torch is imported only when
tokenising so that importing this module, which the plugin manager always does, stays light.
Instances hold only ints, so they pickle to DataLoader workers.
"""

from __future__ import annotations

import re
import zlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

PAD, START, END = 0, 1, 2
NUM_SPECIAL = 3

WORD_RE = re.compile(r"[a-z0-9]+|[^\sa-z0-9]")


def check_context_length(context_length: int) -> None:
    """Start and end tokens need two slots."""
    if context_length < 2:
        raise ValueError(f"context_length must be >= 2 (start + end tokens), got {context_length}")


def check_texts(texts: list[str]) -> None:
    # A bare string would otherwise be tokenised character by character, one row per character.
    if isinstance(texts, str):
        raise TypeError("tokenizers take a list of strings, got a single str")


def pack(rows: list[list[int]], context_length: int) -> Tensor:
    """Content ids per text -> [B, context_length] long: start, ids (truncated), end, padding."""
    import torch

    out = torch.full((len(rows), context_length), PAD, dtype=torch.long)
    for i, ids in enumerate(rows):
        row = [START, *ids[: context_length - 2], END]
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


class HashedWordTokenizer:
    """Lower-cased words and punctuation marks, each hashed (CRC-32, stable across processes,
    unlike ``hash()``) into ids ``3 .. vocab_size - 1``. No vocabulary file; collisions are
    accepted, which is fine for small synthetic corpora and smoke tests.
    """

    def __init__(self, vocab_size: int = 4096, context_length: int = 16) -> None:
        if vocab_size <= NUM_SPECIAL:
            raise ValueError(f"vocab_size must be > {NUM_SPECIAL} (pad, start, end), got {vocab_size}")
        check_context_length(context_length)
        self.vocab_size = vocab_size
        self.context_length = context_length

    def word_id(self, word: str) -> int:
        """The id of one (lower-cased) word: ``crc32(utf-8) % (vocab_size - 3) + 3``."""
        return zlib.crc32(word.encode("utf-8")) % (self.vocab_size - NUM_SPECIAL) + NUM_SPECIAL

    def __call__(self, texts: list[str]) -> Tensor:
        """texts (B strings) -> [B, context_length] long ids."""
        check_texts(texts)
        rows = [[self.word_id(word) for word in WORD_RE.findall(text.lower())] for text in texts]
        return pack(rows, self.context_length)

    def __repr__(self) -> str:
        return f"HashedWordTokenizer(vocab_size={self.vocab_size}, context_length={self.context_length})"


class ByteTokenizer:
    """UTF-8 bytes shifted by 3 (ids 3..258); vocab_size is fixed at 259."""

    def __init__(self, context_length: int = 64) -> None:
        check_context_length(context_length)
        self.vocab_size = 256 + NUM_SPECIAL
        self.context_length = context_length

    def __call__(self, texts: list[str]) -> Tensor:
        """texts (B strings) -> [B, context_length] long ids."""
        check_texts(texts)
        rows = [[byte + NUM_SPECIAL for byte in text.encode("utf-8")] for text in texts]
        return pack(rows, self.context_length)

    def __repr__(self) -> str:
        return f"ByteTokenizer(context_length={self.context_length})"
