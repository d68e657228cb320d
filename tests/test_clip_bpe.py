"""clip_bpe: OpenAI CLIP's BPE tokenizer, checked against ids and splits from the reference.

Provenance of the literals below: a scratch venv (ftfy 6.3.1, regex 2026.11.15, Python 3.11)
ran a verbatim copy of openai/CLIP ``clip/simple_tokenizer.py`` (commit 0848ed71) and
``clip.tokenize(..., truncate=True)`` on the same ``bpe_simple_vocab_16e6.txt.gz`` (byte-identical
to open_clip 3.3.0's). Every golden text also gives the same ids with ftfy absent (the fallback
cleaning), so the tests hold whether or not ftfy is installed. The same script agreed with this
port on every assigned code point in seven split contexts and on 40 000 random texts.
"""

import pickle
import subprocess
import sys
import unicodedata

import pytest
import torch

from clipkit.contract.manager import make_plugin_manager
from clipkit.contract.registry import Registry
from clipkit.plugins.tokenizers import clip_bpe
from clipkit.plugins.tokenizers.clip_bpe import ClipBPETokenizer

START, END = 49406, 49407

# text -> reference ids [start, ..., end] (before padding)
GOLDEN_IDS = {
    "a photo of a cat.": [START, 320, 1125, 539, 320, 2368, 269, END],
    "": [START, END],
    'Hello, world!!! (yes) -- "quoted"; ok?': [
        START, 3306, 267, 1002, 995, 263, 1958, 264, 2432, 257, 27706, 37549, 2481, 286, END,
    ],
    # digits are split one by one
    "In 2023, 3.14 people paid $1,000 for 42 items.": [
        START, 530, 273, 271, 273, 274, 267, 274, 269, 272, 275, 1047, 5057, 259, 272, 267, 271, 271,
        271, 556, 275, 273, 6207, 269, END,
    ],
    "It's what they'll do; we're sure I'd've gone, DON'T you?": [
        START, 585, 568, 768, 889, 1342, 818, 282, 649, 982, 1650, 328, 1896, 1200, 3601, 267, 847, 713,
        592, 286, END,
    ],
    "Café naïve façade, Ünïcödé — 東京 日本語 Ελληνικά": [
        START, 15304, 1097, 35689, 563, 778, 10067, 1928, 267, 6522, 77, 35689, 66, 7255, 67, 4166, 2005,
        48338, 21078, 361, 39121, 44353, 34002, 508, 138, 113, 138, 119, 138, 119, 138, 115, 138, 121,
        138, 117, 138, 118, 138, 361, END,
    ],
    # decomposed and precomposed é: the same word after NFC
    "cafe\u0301 vs caf\u00e9": [START, 15304, 1547, 15304, END],
    "Tom &amp; Jerry &lt;3 &amp;amp; &#39;quoted&#39;": [
        START, 2435, 261, 9164, 283, 274, 261, 262, 27706, 262, END,
    ],
    "  many \t spaces\n\nand   lines  ": [START, 1346, 9006, 537, 3418, END],
    "i love it 👍🏽 🙂": [START, 328, 793, 585, 43722, 14860, END],
    # curly quotes are straightened (ftfy, or the fallback) before splitting
    "the dog\u2019s \u201cbone\u201d": [START, 518, 1929, 568, 257, 6195, 257, END],
    # full-width forms and the fi ligature folded
    "\uff43\uff41\uff54\uff0c\uff44\uff4f\uff47 \ufb01ne": [START, 2368, 267, 1929, 3797, END],
    "supercalifragilisticexpialidocious antidisestablishmentarianism": [
        START, 1642, 2857, 13093, 2076, 5868, 26850, 835, 639, 38466, 3120, 4262, 7726, 12658, 1585,
        44351, END,
    ],
    # a literal special token in the text becomes the special id, as in the reference
    "before <|endoftext|> after": [START, 1348, END, 953, END],
}  # fmt: skip

# cleaned text -> the reference pattern's words (regex.findall with \p{L}/\p{N}, IGNORECASE)
GOLDEN_SPLITS = [
    ("it's 2023! hello,world...", ["it", "'s", "2", "0", "2", "3", "!", "hello", ",", "world", "..."]),
    (
        "don't we'll i'm you've they'd we're 'em",
        ["don", "'t", "we", "'ll", "i", "'m", "you", "'ve", "they", "'d", "we", "'re", "'", "em"],
    ),
    # a contraction only starts a word, never inside a punctuation run
    ("''s ?'s x's 'st", ["''", "s", "?'", "s", "x", "'s", "'s", "t"]),
    # letters (L*) run together; numbers (N*: Nd, No, Nl) one at a time
    (
        "naïve 東京 ελληνικά ½ ² ⅷ ٣٤ x²",
        ["naïve", "東京", "ελληνικά", "½", "²", "ⅷ", "٣", "٤", "x", "²"],
    ),
    # a combining mark (Mn) is neither letter nor number
    ("e\u0301 e\u0301e \u0301", ["e", "\u0301", "e", "\u0301", "e", "\u0301"]),
    (
        '$1,000.50 (ok)-- "q";',
        ["$", "1", ",", "0", "0", "0", ".", "5", "0", "(", "ok", ")--", '"', "q", '";'],
    ),
    (
        "<|startoftext|>hi<|endoftext|> x<|endoftext|> <|endoftext",
        ["<|startoftext|>", "hi", "<|endoftext|>", "x", "<|endoftext|>", "<|", "endoftext"],
    ),
    ("👍🏽🙂 ok", ["👍🏽🙂", "ok"]),
    # white space is Unicode White_Space ...
    ("tab\tnl\nnbsp\xa0ideo\u3000end", ["tab", "nl", "nbsp", "ideo", "end"]),
    # ... which, unlike str.isspace, excludes the information separators \x1c-\x1f
    ("\x1c\x1d a\x1fb", ["\x1c\x1d", "a", "\x1f", "b"]),
    # IGNORECASE quirks: long s folds to s; U+0345 matches no alternative and is dropped
    ("it'\u017f <|\u017ftartoftext|>", ["it", "'\u017f", "<|\u017ftartoftext|>"]),
    ("a\u0345b .\u0345.", ["a", "b", ".", "."]),
]


@pytest.fixture(scope="module")
def tokenizer():
    return ClipBPETokenizer()


@pytest.mark.parametrize("text", list(GOLDEN_IDS))
def test_golden_ids(tokenizer, text):
    expected = GOLDEN_IDS[text]
    row = tokenizer([text])[0]
    assert row.dtype == torch.long and row.shape == (77,)
    assert row.tolist() == expected + [0] * (77 - len(expected))


def test_batch_matches_rows(tokenizer):
    texts = list(GOLDEN_IDS)
    batch = tokenizer(texts)
    assert batch.shape == (len(texts), 77)
    for text, row in zip(texts, batch, strict=True):
        assert row[: len(GOLDEN_IDS[text])].tolist() == GOLDEN_IDS[text]


@pytest.mark.parametrize(("text", "words"), GOLDEN_SPLITS)
def test_split_matches_reference_pattern(text, words):
    assert clip_bpe.split_words(text) == words


def test_split_matches_regex_package_live():
    """Where the ``regex`` package is installed, compare with CLIP's own pattern directly."""
    regex = pytest.importorskip("regex")
    pattern = regex.compile(
        r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+""",
        regex.IGNORECASE,
    )
    samples = [text for text, _ in GOLDEN_SPLITS] + [clip_bpe.clean_text(text) for text in GOLDEN_IDS]
    # runs of consecutive code points; those Python's Unicode database leaves unassigned are left
    # out (regex's newer database may call them letters: a documented difference)
    assigned = [chr(cp) for cp in range(0x3000) if unicodedata.category(chr(cp)) != "Cn"]
    samples += ["".join(assigned[i : i + 400]) for i in range(0, len(assigned), 400)]
    for text in samples:
        assert clip_bpe.split_words(text) == pattern.findall(text), repr(text)


def test_vocabulary_layout():
    tables = clip_bpe.bpe_tables()
    assert ClipBPETokenizer().vocab_size == clip_bpe.VOCAB_SIZE == len(tables.decoder) == 49408
    assert len(tables.ranks) == 48894
    # CLIP's bytes_to_unicode order: "!" (0x21) first, then its end-of-word twin at 256
    assert tables.decoder[0] == "!" and tables.decoder[256] == "!</w>"
    assert tables.decoder[START] == "<|startoftext|>" and tables.decoder[END] == "<|endoftext|>"
    # the space byte is remapped to chr(256 + 32): the 33rd non-printable byte
    assert tables.byte_encoder[ord(" ")] == "\u0120" and tables.byte_encoder[0] == "\u0100"
    assert tables.encoder["cat</w>"] == 2368


def test_truncation_keeps_end_token():
    text = " ".join(["photo"] * 100)  # "photo</w>" = 1125, one id per word
    row = ClipBPETokenizer(context_length=10)([text])[0].tolist()
    assert row == [START] + [1125] * 8 + [END]
    fits = " ".join(["photo"] * 8)  # exactly 10 ids with start and end: no error, no padding
    assert ClipBPETokenizer(context_length=10, truncate=False)([fits])[0].tolist() == row


def test_too_long_without_truncation_names_the_text():
    text = " ".join(["photo"] * 9)
    with pytest.raises(ValueError, match="photo photo photo"):
        ClipBPETokenizer(context_length=10, truncate=False)(["short", text])


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="context_length"):
        ClipBPETokenizer(context_length=1)
    with pytest.raises(TypeError, match="list of strings"):
        ClipBPETokenizer()("a single string")


def test_exclamation_mark_can_be_id_zero_inside_the_row(tokenizer):
    # "!" not ending a word is id 0, the padding value ("!</w>" is 256); reference ids
    row = tokenizer(["hi!\U0001f642"])[0].tolist()
    assert row[:5] == [START, 1883, 0, 14860, END]
    # text encoders pool at the last non-zero position, which is still the end token
    assert max(i for i, token in enumerate(row) if token != 0) == 4


def test_decode(tokenizer):
    assert tokenizer.decode(tokenizer(["A photo of a cat."])[0]) == "a photo of a cat ."
    assert tokenizer.decode(tokenizer.encode("Café 東京 👍🏽")) == "café 東京 👍🏽"
    assert tokenizer.decode(torch.tensor([START, 1883, 0, 14860, END, 0, 0])) == "hi !\U0001f642"


def test_fallback_cleaning_without_ftfy():
    # hand-derived: ligature unfolded, full-width to ASCII, curly quotes straightened, NFC
    text = "the dog\u2019s \u201c\ufb01ne\u201d \uff43\uff41\uff54\uff0c cafe\u0301\u3000"
    assert clip_bpe.fallback_fix_text(text) == 'the dog\'s "fine" cat, caf\u00e9 '


def test_pickle_round_trip_carries_only_options(tokenizer):
    texts = list(GOLDEN_IDS)
    payload = pickle.dumps(tokenizer)
    assert len(payload) < 200  # no vocabulary inside
    clone = pickle.loads(payload)
    assert repr(clone) == "ClipBPETokenizer(context_length=77, truncate=True)"
    assert torch.equal(clone(texts), tokenizer(texts))


def test_import_is_light():
    """Registering must not import torch or read the vocabulary."""
    code = (
        "import sys; import clipkit.plugins.tokenizers.clip_bpe as m; "
        "assert 'torch' not in sys.modules; "
        "assert m.bpe_tables.cache_info().currsize == 0 and m.split_pattern.cache_info().currsize == 0"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_registered_as_clip_bpe():
    registry = Registry(make_plugin_manager(autoload=False))
    assert "clip_bpe" in registry.names("tokenizer")
    entry = registry.get("tokenizer", "clip_bpe")
    assert entry.plugin == "clipkit.plugins.tokenizers"
    built = registry.factory("tokenizer", "clip_bpe")(context_length=32)
    assert isinstance(built, ClipBPETokenizer) and built.context_length == 32
