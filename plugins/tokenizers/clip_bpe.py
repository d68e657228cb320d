"""CLIP's byte-level BPE tokenizer, registered as ``clip_bpe``.

A dependency-free port of OpenAI CLIP's ``clip/simple_tokenizer.py`` (MIT, Copyright (c) 2021
OpenAI; the vocabulary and its licence are vendored in ``clip_bpe_vocab/``). For the same input it
gives the same ids as ``clip.tokenize`` (``truncate=True``) and open_clip's tokenizer, so models
trained here share CLIP's text vocabulary (49 408 ids):

    0 .. 255        the 256 byte symbols (in CLIP's ``bytes_to_unicode`` order, so 0 is "!")
    256 .. 511      the same symbols ending a word ("...</w>")
    512 .. 49405    the 48 894 merges, in rank order
    49406, 49407    ``<|startoftext|>``, ``<|endoftext|>``

Pipeline, as in the reference: clean (``ftfy.fix_text`` when ftfy is importable, ``html.unescape``
twice, strip, collapse whitespace runs to one space, strip, lower-case) -> split into words with
CLIP's pattern -> UTF-8 bytes as symbols -> merge by rank -> ids.

Differences from the reference, none of which changes ids for well-formed text:

* CLIP splits with the ``regex`` package's ``\\p{L}``/``\\p{N}``; here the same pattern runs on the
  standard library's ``re`` with those classes spelled out from ``unicodedata`` (see
  :func:`split_pattern`). Characters that Python's Unicode database (14.0 on Python 3.11) does
  not know yet but ``regex``'s newer one does count as punctuation here rather than letters.
* ftfy is optional. Without it :func:`fallback_fix_text` applies ftfy's plain character mappings
  (ligatures, full-width forms, curly quotes, NFC), which cover what changes ordinary well-formed
  text; mojibake repair and the like need ``pip install ftfy``. Install it where you compare with
  pretrained CLIP weights or want ids independent of the environment.

Id 0 is both "!" (when it does not end a word: "!🙂" -> [0, 14860]) and the padding value, as in
OpenAI CLIP and open_clip: rows are ``[49406, ids..., 49407, 0, 0, ...]`` and text encoders find
the end token as the last non-zero position, so a "!" inside the text does not end it early. (A
token-level mask ``tokens != 0`` does hide those "!" positions.) A literal ``<|startoftext|>`` or
``<|endoftext|>`` in a caption becomes the special id, as in the reference.

Only options are pickled (DataLoader workers); the vocabulary, the split pattern and the word
cache are built once per process on first use, so importing this module stays light.
"""

from __future__ import annotations

import functools
import gzip
import html
import importlib.resources
import re
import sys
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from clipkit.plugins.tokenizers.basic import check_context_length, check_texts

if TYPE_CHECKING:
    from torch import Tensor

VOCAB_PACKAGE = "clipkit.plugins.tokenizers"
VOCAB_DIR = "clip_bpe_vocab"
VOCAB_FILE = "bpe_simple_vocab_16e6.txt.gz"

START_TOKEN, END_TOKEN = "<|startoftext|>", "<|endoftext|>"
END_OF_WORD = "</w>"
#: The reference keeps the first 49152 - 256 - 2 merges (after the header line) of the file.
NUM_MERGES = 49152 - 256 - 2
VOCAB_SIZE = 2 * 256 + NUM_MERGES + 2
PAD_ID, START_ID, END_ID = 0, VOCAB_SIZE - 2, VOCAB_SIZE - 1

#: Unicode White_Space, the ``regex`` package's ``\s``. Python's ``re`` ``\s`` also matches
#: \x1c-\x1f, which CLIP's pattern treats as punctuation.
WHITE_SPACE = r"\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
WHITE_SPACE_RUN = re.compile(f"[{WHITE_SPACE}]+")

#: Bound on the per-process word cache (cleared when full; captions reuse few words).
WORD_CACHE_SIZE = 1 << 18


def bytes_to_unicode() -> dict[int, str]:
    """CLIP's byte -> printable character table, in its order (which fixes ids 0..511).

    Printable Latin-1 bytes map to themselves; the rest (controls, space, ...) to chr(256 + n), so
    every BPE symbol is a visible character and no byte is lost.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    others = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable}
    table.update({b: chr(256 + n) for n, b in enumerate(others)})
    return table


@dataclass(frozen=True)
class BPETables:
    """The vocabulary in lookup form: symbol string <-> id, merge pair -> rank, byte <-> symbol."""

    encoder: dict[str, int]
    decoder: list[str]
    ranks: dict[tuple[str, str], int]
    byte_encoder: dict[int, str]
    byte_decoder: dict[str, int]


@functools.cache
def bpe_tables() -> BPETables:
    """Read the vendored merges file once per process and build the lookup tables."""
    resource = importlib.resources.files(VOCAB_PACKAGE).joinpath(VOCAB_DIR).joinpath(VOCAB_FILE)
    lines = gzip.decompress(resource.read_bytes()).decode("utf-8").split("\n")
    merges = [tuple(line.split()) for line in lines[1 : NUM_MERGES + 1]]  # line 0 is a version header
    byte_encoder = bytes_to_unicode()
    symbols = list(byte_encoder.values())
    vocab = [*symbols, *(s + END_OF_WORD for s in symbols), *("".join(m) for m in merges)]
    vocab += [START_TOKEN, END_TOKEN]
    if len(vocab) != VOCAB_SIZE:
        raise RuntimeError(f"{VOCAB_FILE}: expected {VOCAB_SIZE} tokens, read {len(vocab)}")
    return BPETables(
        encoder={token: i for i, token in enumerate(vocab)},
        decoder=vocab,
        ranks={pair: rank for rank, pair in enumerate(merges)},
        byte_encoder=byte_encoder,
        byte_decoder={s: b for b, s in byte_encoder.items()},
    )


def category_classes(majors: str = "LN") -> dict[str, str]:
    """``re`` character-class bodies listing, as ranges, every code point whose general category
    starts with each of ``majors`` ("L" letters, "N" numbers): the stdlib spelling of ``\\p{L}``
    and ``\\p{N}``. One pass over all code points."""
    ranges: dict[str, list[list[int]]] = {major: [] for major in majors}
    for cp in range(sys.maxunicode + 1):
        spans = ranges.get(unicodedata.category(chr(cp))[0])
        if spans is None:
            continue
        if spans and spans[-1][1] == cp - 1:
            spans[-1][1] = cp
        else:
            spans.append([cp, cp])
    return {
        major: "".join(f"\\U{a:08x}" if a == b else f"\\U{a:08x}-\\U{b:08x}" for a, b in spans)
        for major, spans in ranges.items()
    }


@functools.cache
def split_pattern() -> re.Pattern[str]:
    """CLIP's pre-tokenisation pattern (``regex`` module, IGNORECASE) on the standard library::

        <\\|startoftext\\|>|<\\|endoftext\\|>|'s|'t|'re|'ve|'m|'ll|'d|[\\p{L}]+|[\\p{N}]|[^\\s\\p{L}\\p{N}]+

    Specials, contractions, letter runs, single digits (numbers split digit by digit), runs of
    anything else but white space. The text is already lower-case, so IGNORECASE only adds the
    case-folding quirks spelled out here: "ſ" (U+017F, folds to s) matches the s of "'s" and
    "<|startoftext|>", and U+0345 (combining ypogegrammeni, folds to the letter iota) falls
    outside the negated class without being a letter, so the reference silently drops it.
    Built once per process (~0.2 s: one ``unicodedata.category`` call per code point).
    """
    classes = category_classes("LN")
    letters, numbers = classes["L"], classes["N"]
    return re.compile(
        r"<\|[sſ]tartoftext\|>|<\|endoftext\|>"
        r"|'[sſ]|'t|'re|'ve|'m|'ll|'d"
        f"|[{letters}]+|[{numbers}]"
        f"|[^{WHITE_SPACE}{letters}{numbers}\\u0345]+"
    )


def split_words(cleaned: str) -> list[str]:
    """Cleaned text -> CLIP's words, e.g. "it's 2023!" -> ["it", "'s", "2", "0", "2", "3", "!"]."""
    return split_pattern().findall(cleaned)


#: ftfy's table-driven fixes (ftfy 6.3 ``chardata``): Latin ligatures and digraphs, then
#: half/full-width forms (and the ideographic space) to standard width, then curly quotes.
FTFY_LIGATURES = str.maketrans(
    {
        "Ĳ": "IJ", "ĳ": "ij", "ŉ": "ʼn", "Ǳ": "DZ", "ǲ": "Dz", "ǳ": "dz", "Ǆ": "DŽ", "ǅ": "Dž", "ǆ": "dž",
        "Ǉ": "LJ", "ǈ": "Lj", "ǉ": "lj", "Ǌ": "NJ", "ǋ": "Nj", "ǌ": "nj",
        "ﬀ": "ff", "ﬁ": "fi", "ﬂ": "fl", "ﬃ": "ffi", "ﬄ": "ffl", "ﬅ": "ſt", "ﬆ": "st",
    }
)  # fmt: skip
FTFY_WIDTHS = {0x3000: " "} | {
    cp: unicodedata.normalize("NFKC", chr(cp))
    for cp in range(0xFF01, 0xFFF0)
    if unicodedata.normalize("NFKC", chr(cp)) != chr(cp)
}
FTFY_QUOTES = str.maketrans(
    dict.fromkeys("\u02bc\u2018\u2019\u201a\u201b", "'") | dict.fromkeys("\u201c\u201d\u201e\u201f", '"')
)


def fallback_fix_text(text: str) -> str:
    """Stand-in for ``ftfy.fix_text`` when ftfy is not installed: its fixes that are plain
    character mappings, in its order (ligatures, character width, curly quotes, NFC), so that
    e.g. "dog’s" still ends in the "'s" contraction and "ｃａｔ，" is "cat,". What needs ftfy
    itself is its heuristics: mojibake repair ("cafÃ©" -> "café"), HTML unescaping of a third
    level, control and terminal-escape removal."""
    text = text.translate(FTFY_LIGATURES).translate(FTFY_WIDTHS).translate(FTFY_QUOTES)
    return unicodedata.normalize("NFC", text)


@functools.cache
def fix_text_function():
    """``ftfy.fix_text`` if ftfy is importable, else :func:`fallback_fix_text` (checked once)."""
    try:
        import ftfy
    except ImportError:
        return fallback_fix_text
    return ftfy.fix_text


def clean_text(text: str) -> str:
    """The reference's ``whitespace_clean(basic_clean(text)).lower()``."""
    text = html.unescape(html.unescape(fix_text_function()(text))).strip()
    return WHITE_SPACE_RUN.sub(" ", text).strip().lower()


def bpe(symbols: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """Merge one word's byte symbols: repeatedly join every (left-to-right, non-overlapping)
    occurrence of the adjacent pair with the lowest merge rank, until no adjacent pair has one.
    The last symbol carries ``</w>``. E.g. "cat" -> ["cat</w>"]."""
    word = [*symbols[:-1], symbols[-1] + END_OF_WORD]
    while len(word) > 1:
        best = min(zip(word, word[1:], strict=False), key=lambda pair: ranks.get(pair, NUM_MERGES))
        if best not in ranks:
            break
        first, second = best
        merged, i = [], 0
        while i < len(word):
            if i + 1 < len(word) and word[i] == first and word[i + 1] == second:
                merged.append(first + second)
                i += 2
            else:
                merged.append(word[i])
                i += 1
        word = merged
    return word


_word_ids: dict[str, tuple[int, ...]] = {START_TOKEN: (START_ID,), END_TOKEN: (END_ID,)}


def word_ids(word: str) -> tuple[int, ...]:
    """The ids of one word from :func:`split_words`, cached per process (captions repeat words)."""
    ids = _word_ids.get(word)
    if ids is None:
        tables = bpe_tables()
        symbols = "".join(tables.byte_encoder[b] for b in word.encode("utf-8"))
        ids = tuple(tables.encoder[piece] for piece in bpe(symbols, tables.ranks))
        if len(_word_ids) >= WORD_CACHE_SIZE:
            _word_ids.clear()
            _word_ids.update({START_TOKEN: (START_ID,), END_TOKEN: (END_ID,)})
        _word_ids[word] = ids
    return ids


class ClipBPETokenizer:
    """OpenAI CLIP's tokenizer: ``texts (B strings) -> [B, context_length]`` long ids.

    Each row is ``[49406, ids..., 49407, 0, ...]``. A text longer than ``context_length - 2`` ids
    is cut so that the end token takes the last slot (``truncate=True``, what open_clip always
    does) or raises ValueError naming the text (``truncate=False``, ``clip.tokenize``'s default).
    Id 0 is "!" as well as padding; see the module docstring.
    """

    def __init__(self, context_length: int = 77, truncate: bool = True) -> None:
        check_context_length(context_length)
        self.vocab_size = VOCAB_SIZE
        self.context_length = context_length
        self.truncate = truncate

    def encode(self, text: str) -> list[int]:
        """One text -> its BPE ids, without start/end tokens or padding."""
        return [i for word in split_words(clean_text(text)) for i in word_ids(word)]

    def row(self, text: str) -> list[int]:
        """One text -> ``[START, ids..., END]``, truncated to ``context_length`` (unpadded)."""
        ids = [START_ID, *self.encode(text), END_ID]
        if len(ids) > self.context_length:
            if not self.truncate:
                raise ValueError(
                    f"text is too long for context_length={self.context_length} "
                    f"({len(ids)} tokens with start and end): {text!r}"
                )
            ids = [*ids[: self.context_length - 1], END_ID]
        return ids

    def __call__(self, texts: list[str]) -> Tensor:
        """texts (B strings) -> [B, context_length] long ids."""
        import torch

        check_texts(texts)
        rows = [self.row(text) for text in texts]
        padded = [row + [PAD_ID] * (self.context_length - len(row)) for row in rows]
        return torch.tensor(padded, dtype=torch.long).reshape(len(rows), self.context_length)

    def decode(self, ids: Iterable[int]) -> str:
        """Ids (a list or a 1-D tensor, e.g. one row of ``__call__``) -> text, for debugging.

        Drops a leading start token and everything from the last end token on (the padding);
        words come back lower-case and space-separated, punctuation as its own word
        ("a photo of a cat ."). Without an end token every id is decoded, zeros as "!".
        """
        ids = [int(i) for i in ids]
        if ids and ids[0] == START_ID:
            ids = ids[1:]
        if END_ID in ids:
            ids = ids[: len(ids) - 1 - ids[::-1].index(END_ID)]
        tables = bpe_tables()
        pieces = []
        for i in ids:
            token = tables.decoder[i]
            if i in (START_ID, END_ID):
                pieces.append(token.encode("utf-8"))
            else:
                pieces.append(bytes(tables.byte_decoder[c] for c in token.removesuffix(END_OF_WORD)))
                pieces.append(b" " if token.endswith(END_OF_WORD) else b"")
        return b"".join(pieces).decode("utf-8", errors="replace").strip()

    def __repr__(self) -> str:
        return f"ClipBPETokenizer(context_length={self.context_length}, truncate={self.truncate})"
