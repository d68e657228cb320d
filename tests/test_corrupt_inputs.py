"""Issue 5, bad input: 200 generated corrupt rows per source, interleaved with good ones.

Every corrupt row of a JSONL table, a CSV table and a caption folder is skipped and counted under
the reason it was generated for (no exception), the shards hold exactly the good rows and every
image in them decodes, and ``strict`` stops at the first corrupt row naming its file and line.
"""

from __future__ import annotations

import collections
import io
import json
import random
import re
import struct
import zlib
from pathlib import Path

import pytest
from PIL import Image

from clipkit.app import api
from clipkit.data.shard import ShardSource, open_source, read_manifest
from clipkit.errors import DataError
from clipkit.plugins.sources.file_sources import DEFAULT_MAX_CAPTION_CHARS, BadRow, verify_image_bytes

N_CORRUPT = 200
N_GOOD = 40
RNG_SEED = 5


# --------------------------------------------------------------------------------------------
# Image bytes


def encoded(rng: random.Random, image_format: str, size: int = 24) -> bytes:
    """Noise pixels (so the compressed data is long) encoded as ``image_format``."""
    image = Image.frombytes("RGB", (size, size), rng.randbytes(size * size * 3))
    buffer = io.BytesIO()
    image.save(buffer, format=image_format)
    return buffer.getvalue()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_declaring(width: int, height: int) -> bytes:
    """A ~70-byte PNG whose header declares ``width`` × ``height`` RGB pixels (a decompression bomb)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", header)
        + png_chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + png_chunk(b"IEND", b"")
    )


def truncated_jpeg_scan(rng: random.Random) -> bytes:
    """Cut inside the entropy-coded data (after the start-of-scan marker, before the end marker):
    ``Image.verify`` accepts these; decoding does not."""
    data = encoded(rng, "JPEG")
    start_of_scan = data.index(b"\xff\xda")
    return data[: rng.randrange(start_of_scan + 2, len(data) - 2)]


def truncated_jpeg_header(rng: random.Random) -> bytes:
    data = encoded(rng, "JPEG")
    return data[: rng.randrange(1, data.index(b"\xff\xda"))]


def truncated_png(rng: random.Random) -> bytes:
    """Cut anywhere before the last 8 bytes of the compressed pixel data (a cut in the final zlib
    checksum still decodes every pixel, so it is not a corrupt input)."""
    data = encoded(rng, "PNG")
    idat = data.index(b"IDAT")
    (length,) = struct.unpack(">I", data[idat - 4 : idat])
    return data[: rng.randrange(1, idat + 4 + length - 8)]


def truncated_bmp(rng: random.Random) -> bytes:
    """Cut inside the pixel array (``Image.verify`` accepts these too)."""
    data = encoded(rng, "BMP")
    return data[: rng.randrange(60, len(data) - 1)]


def header_then_garbage(rng: random.Random) -> bytes:
    """A real PNG or JPEG header followed by random bytes."""
    if rng.random() < 0.5:
        return encoded(rng, "PNG")[:33] + rng.randbytes(rng.randrange(10, 400))
    data = encoded(rng, "JPEG")
    return data[: data.index(b"\xff\xc0")] + rng.randbytes(rng.randrange(10, 400))


def zero_width_png(rng: random.Random) -> bytes:
    return png_declaring(0, rng.randrange(1, 50))


def gif(rng: random.Random) -> bytes:
    return encoded(rng, "GIF", size=8)


#: Corrupt image kinds -> (bytes maker, the reason the row is counted under).
BAD_IMAGES = {
    "jpeg_cut_in_scan": (truncated_jpeg_scan, "bad_image"),
    "jpeg_cut_in_header": (truncated_jpeg_header, "bad_image"),
    "png_cut": (truncated_png, "bad_image"),
    "bmp_cut": (truncated_bmp, "bad_image"),
    "random_bytes": (lambda rng: rng.randbytes(rng.randrange(1, 2000)), "bad_image"),
    "zero_bytes": (lambda rng: b"", "bad_image"),
    "header_then_garbage": (header_then_garbage, "bad_image"),
    "zero_width": (zero_width_png, "bad_image"),
    "bomb_warning": (lambda rng: png_declaring(10_000, 10_000), "image_too_large"),  # > MAX_IMAGE_PIXELS
    "bomb_error": (lambda rng: png_declaring(100_000, 100_000), "image_too_large"),  # > 2 × MAX
    "gif": (gif, "unsupported_image"),
}

GOOD_FORMATS = ("PNG", "JPEG", "WEBP", "BMP")
EXTENSIONS = {"PNG": ".png", "JPEG": ".jpg", "WEBP": ".webp", "BMP": ".bmp"}
TOO_LONG = DEFAULT_MAX_CAPTION_CHARS + 1


def long_text(rng: random.Random, length: int) -> str:
    """Words, exactly ``length`` characters (no trailing space that stripping would remove)."""
    words = [rng.choice(("cat", "on", "a", "mat", "blue", "sky")) for _ in range(length // 3 + 1)]
    return " ".join(words)[: length - 1] + "s"


# --------------------------------------------------------------------------------------------
# Generating the rows: each corrupt kind writes what it needs and returns (row, expected reason)


class Generator:
    """Writes image files under ``root`` and builds rows; one seeded ``rng`` drives everything."""

    def __init__(self, root: Path, rng: random.Random) -> None:
        self.root, self.rng = root, rng
        self.count = 0

    def image_file(self, data: bytes, suffix: str = ".png") -> str:
        self.count += 1
        name = f"img/{self.count:04d}{suffix}"
        (self.root / name).parent.mkdir(parents=True, exist_ok=True)
        (self.root / name).write_bytes(data)
        return name

    def good_image(self) -> str:
        image_format = self.rng.choice(GOOD_FORMATS)
        return self.image_file(encoded(self.rng, image_format, size=8), EXTENSIONS[image_format])

    def bad_image(self, kind: str) -> tuple[str, str]:
        make, reason = BAD_IMAGES[kind]
        return self.image_file(make(self.rng), self.rng.choice((".png", ".jpg"))), reason


def table_kinds(gen: Generator, text_format: str) -> dict[str, object]:
    """Corrupt kinds of a table row: each returns (cells: dict or raw line bytes, reason)."""
    rng = gen.rng

    def image_kind(kind):
        def make():
            image, reason = gen.bad_image(kind)
            return {"image": image, "caption": "fine"}, reason

        return make

    def directory():
        name = f"dir{rng.randrange(10**6)}.png"
        (gen.root / name).mkdir(exist_ok=True)
        return {"image": name, "caption": "fine"}, "not_a_file"  # issue 19: counted as what it is

    def cells(reason, **row):
        return lambda: ({"image": gen.good_image(), "caption": "fine", **row}, reason)

    kinds = {f"image_{kind}": image_kind(kind) for kind in BAD_IMAGES}
    kinds.update(
        missing_file=lambda: (
            {"image": f"absent/{rng.randrange(10**6)}.jpg", "caption": "x"},
            "missing_image",
        ),
        directory_named_like_an_image=directory,
        empty_image_cell=lambda: ({"image": "", "caption": "x"}, "missing_image"),
        nul_in_image_path=lambda: ({"image": "img/a\0b.png", "caption": "x"}, "missing_image"),
        empty_caption=cells("empty_caption", caption=""),
        whitespace_caption=cells("empty_caption", caption=" \t \u3000 "),
        control_only_caption=cells("empty_caption", caption="\x0b\x0c\x1b"),
        nul_caption=cells("bad_caption", caption="a\0b"),
        enormous_caption=lambda: (
            {"image": gen.good_image(), "caption": long_text(rng, rng.randrange(TOO_LONG, 50_000))},
            "caption_too_long",
        ),
    )
    if text_format == "jsonl":
        kinds.update(
            no_image_key=lambda: ({"caption": "x"}, "missing_image"),
            no_captions=cells("empty_caption", captions=[], caption=None),
            number_caption=cells("bad_caption", caption=7),
            object_caption=cells("bad_caption", caption={"text": "x"}),
            nested_list_caption=cells("bad_caption", captions=[["x"]]),
            lone_surrogate_caption=lambda: (b'{"image": "x.png", "caption": "a\\udc80"}', "bad_encoding"),
            latin1_line=lambda: (b'{"image": "x.png", "caption": "caf\xe9"}', "bad_encoding"),
            nan_meta=lambda: (
                json.dumps({"image": gen.good_image(), "caption": "x", "score": float("nan")}).encode(),
                "bad_meta",
            ),
            infinity_meta=lambda: (b'{"image": "x.png", "caption": "x", "w": -Infinity}', "bad_meta"),
            overflowing_meta=lambda: (b'{"image": "x.png", "caption": "x", "w": 1e999}', "bad_meta"),
            surrogate_meta=lambda: (b'{"image": "x.png", "caption": "x", "who": "\\ud800"}', "bad_meta"),
            cut_json_line=lambda: (b'{"image": "x.png", "caption": ', "bad_line"),
            array_line=lambda: (b'["x.png", "caption"]', "bad_line"),
            huge_int_line=lambda: (
                b'{"image": "x.png", "caption": "x", "n": ' + b"9" * 5000 + b"}",
                "bad_line",
            ),
            deeply_nested_line=lambda: (b"[" * 100_000 + b"]" * 100_000, "bad_line"),
        )
    else:
        kinds.update(
            latin1_cell=lambda: (b"x.png,caf\xe9,1", "bad_encoding"),
            too_many_fields=lambda: (b"x.png,a caption,1,2", "bad_line"),
            too_few_fields=lambda: (b"x.png", "bad_line"),
            cell_over_csv_field_limit=lambda: (b"x.png," + b"a" * 140_000 + b",1", "bad_line"),
        )
    return kinds


def good_row(gen: Generator, index: int) -> dict:
    """A good row; some have stray control characters (kept, as spaces) or a caption exactly at the
    length limit, and CSV meta that merely looks like a non-finite number ("nan", "Nan")."""
    caption = [f"good {index}", f"good\x0b{index}", long_text(gen.rng, DEFAULT_MAX_CAPTION_CHARS)][index % 3]
    return {"image": gen.good_image(), "caption": caption, "note": ["nan", "Nan", "x"][index % 3]}


def interleave(rng: random.Random, kinds: dict) -> list[tuple[str, object]]:
    """N_CORRUPT corrupt kinds (each at least once, the rest drawn at random) and N_GOOD "good" in
    random order."""
    names = sorted(kinds)
    assert len(names) <= N_CORRUPT
    corrupt = names + [rng.choice(names) for _ in range(N_CORRUPT - len(names))]
    plan = corrupt + ["good"] * N_GOOD
    rng.shuffle(plan)
    return plan


def write_table(root: Path, text_format: str) -> tuple[Path, list[int], collections.Counter, int]:
    """The table, the data-row indices of its good rows, the expected skip counts and the
    (1-based) line of its first corrupt row."""
    rng = random.Random(f"{RNG_SEED}:{text_format}")
    gen = Generator(root, rng)
    kinds = table_kinds(gen, text_format)
    lines = [b"image,caption,note"] if text_format == "csv" else []
    good, expected, first_bad_line = [], collections.Counter(), None
    for row_index, name in enumerate(interleave(rng, kinds)):
        if name == "good":
            row, reason = good_row(gen, row_index), None
            good.append(row_index)
        else:
            row, reason = kinds[name]()
            expected[reason] += 1
            first_bad_line = first_bad_line or len(lines) + 1
        lines.append(row if isinstance(row, bytes) else encode_row(row, text_format))
    path = root / f"table.{text_format}"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path, good, expected, first_bad_line


def encode_row(row: dict, text_format: str) -> bytes:
    if text_format == "jsonl":
        return json.dumps(row).encode("utf-8")
    cells = [row["image"], row["caption"], row.get("note", "1")]
    assert not any(c in cell for cell in cells for c in ',"\n\r'), cells  # one physical line per row
    return ",".join(cells).encode("utf-8")


def write_caption_folder(root: Path) -> tuple[Path, list[str], collections.Counter, Path]:
    """A caption folder: ``NNNN.<ext>`` + ``NNNN.txt`` (+ ``NNNN.json``); returns it, the good keys,
    the expected skip counts and the first corrupt image (sorted order = generation order)."""
    rng = random.Random(f"{RNG_SEED}:folder")
    folder = root / "folder"
    folder.mkdir()

    def bad_image(kind):
        return lambda stem: (BAD_IMAGES[kind][0](rng), ".png", "fine", None, BAD_IMAGES[kind][1])

    def good_image(stem, caption, meta, reason):
        image_format = rng.choice(GOOD_FORMATS)
        return encoded(rng, image_format, size=8), EXTENSIONS[image_format], caption, meta, reason

    kinds = {f"image_{kind}": bad_image(kind) for kind in BAD_IMAGES}
    kinds.update(
        missing_caption_file=lambda stem: good_image(stem, None, None, "missing_caption"),
        caption_file_is_a_directory=lambda stem: good_image(stem, "DIR", None, "not_a_file"),
        empty_caption_file=lambda stem: good_image(stem, b"", None, "empty_caption"),
        blank_lines_only=lambda stem: good_image(stem, "\n  \n\t\r\n", None, "empty_caption"),
        latin1_caption=lambda stem: good_image(stem, b"caf\xe9\n", None, "bad_encoding"),
        utf16_caption=lambda stem: good_image(stem, "a cat".encode("utf-16-le"), None, "bad_caption"),
        enormous_caption=lambda stem: good_image(stem, long_text(rng, TOO_LONG), None, "caption_too_long"),
        nan_meta=lambda stem: good_image(stem, "fine", '{"score": NaN}', "bad_meta"),
        invalid_json_meta=lambda stem: good_image(stem, "fine", '{"score": ', "bad_meta"),
        array_meta=lambda stem: good_image(stem, "fine", "[1, 2]", "bad_meta"),
        nested_meta=lambda stem: good_image(stem, "fine", '{"exif": {"iso": 100}}', "bad_meta"),
        latin1_meta=lambda stem: good_image(stem, "fine", b'{"who": "caf\xe9"}', "bad_meta"),
        huge_int_meta=lambda stem: good_image(stem, "fine", '{"n": ' + "9" * 5000 + "}", "bad_meta"),
    )
    good, expected, first_bad = [], collections.Counter(), None
    for number, name in enumerate(interleave(rng, kinds)):
        stem = f"{number:04d}"
        if name == "good":
            caption = [f"good {number}", f"first\n\nsecond\x1b{number}\n"][number % 2]
            data, ext, caption, meta, reason = good_image(stem, caption, '{"i": 1, "tags": ["a"]}', None)
            good.append(stem)
        else:
            data, ext, caption, meta, reason = kinds[name](stem)
            expected[reason] += 1
            first_bad = first_bad or folder / f"{stem}{ext}"
        (folder / f"{stem}{ext}").write_bytes(data)
        if caption == "DIR":
            (folder / f"{stem}.txt").mkdir()
        elif caption is not None:
            text = caption if isinstance(caption, bytes) else caption.encode("utf-8")
            (folder / f"{stem}.txt").write_bytes(text)
        if meta is not None:
            (folder / f"{stem}.json").write_bytes(meta if isinstance(meta, bytes) else meta.encode("utf-8"))
    (folder / "not_an_image.png").mkdir()  # a directory named like an image: refused and counted
    expected["not_a_file"] += 1
    return folder, good, expected, first_bad


# --------------------------------------------------------------------------------------------
# Tests


def check_shards(directory: Path, good_keys: list[str]) -> None:
    """The shards hold exactly the good rows, in order, and every image decodes fully."""
    read = list(ShardSource(directory))
    assert [sample.key for sample in read] == good_keys
    for sample in read:
        with Image.open(io.BytesIO(sample.image)) as image:
            image.load()
        assert sample.captions and all(len(c) <= DEFAULT_MAX_CAPTION_CHARS for c in sample.captions)
        assert not any(re.search(r"[\x00-\x08\x0b\x0c\x0e-\x1f]", c) for c in sample.captions)


@pytest.mark.parametrize("text_format", ["jsonl", "csv"])
def test_corrupt_table_rows_are_skipped_and_counted(tmp_path, text_format):
    path, good, expected, first_bad_line = write_table(tmp_path, text_format)
    assert sum(expected.values()) == N_CORRUPT and len(good) == N_GOOD
    manifest = api.shard(str(path), tmp_path / "shards", options={"workers": "2"})
    assert manifest["n"] == N_GOOD
    assert read_manifest(tmp_path / "shards")["info"]["skipped"] == dict(sorted(expected.items()))
    check_shards(tmp_path / "shards", [str(index) for index in good])
    read = {s.key: s for s in ShardSource(tmp_path / "shards")}
    if text_format == "csv":  # "nan" in a CSV cell is text, not a NaN that would spoil the JSON
        assert {read[str(i)].meta["note"] for i in good} == {"nan", "Nan", "x"}
    assert any(s.captions[0].startswith("good ") and "\x0b" not in s.captions[0] for s in read.values())
    with pytest.raises(DataError, match=re.escape(f"{path}: line {first_bad_line}: ")):
        list(open_source(str(path), {"strict": "true"}))


def test_corrupt_caption_folder_entries_are_skipped_and_counted(tmp_path):
    folder, good, expected, first_bad = write_caption_folder(tmp_path)
    assert sum(expected.values()) == N_CORRUPT + 1 and len(good) == N_GOOD  # + the directory not_an_image.png
    manifest = api.shard(f"folder:{folder}", tmp_path / "shards")
    assert manifest["n"] == N_GOOD
    assert manifest["info"]["skipped"] == dict(sorted(expected.items()))
    check_shards(tmp_path / "shards", good)
    for sample in ShardSource(tmp_path / "shards"):  # stored as given, meta-data kept
        (image_path,) = [p for p in folder.glob(f"{sample.key}.*") if p.suffix not in (".txt", ".json")]
        assert sample.image == image_path.read_bytes() and sample.meta["tags"] == ["a"]
    with pytest.raises(DataError, match=re.escape(f"{first_bad}: ")):
        list(open_source(f"folder:{folder}", {"strict": "true"}))


def test_full_decode_catches_what_verify_lets_through():
    """The reason for decoding at shard time: ``Image.verify`` passes these truncated files."""
    rng = random.Random(RNG_SEED)
    for cut in (truncated_jpeg_scan(rng), truncated_bmp(rng)):
        with Image.open(io.BytesIO(cut)) as image:
            image.verify()  # no error
        with pytest.raises(BadRow, match="does not decode.*truncated") as caught:
            verify_image_bytes(cut, "cut")
        assert caught.value.reason == "bad_image"
    shard_fields = {"PNG": "png", "JPEG": "jpg", "WEBP": "webp", "BMP": "bmp"}
    for image_format, field in shard_fields.items():
        assert verify_image_bytes(encoded(rng, image_format), "ok") == field


def test_caption_limit_and_meta_columns_options(tmp_path):
    Image.new("RGB", (4, 4)).save(tmp_path / "a.png")
    rows = [
        {"image": "a.png", "caption": "x" * 50, "m": [1, 2]},
        {"image": "a.png", "caption": "x" * 51, "m": [1, 2]},  # caption_too_long at 50
        {"image": "a.png", "caption": "ok", "m": {"nested": 1}},  # bad_meta: an object
        {"image": "a.png", "caption": "ok", "m": [[1], [2]]},  # bad_meta: a list of lists
    ]
    table = tmp_path / "t.jsonl"
    table.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    source = open_source(f"{table}?meta=m", {"max_caption_chars": "50"})  # CLI options are strings
    assert [s.meta for s in source] == [{"m": [1, 2]}]
    assert source.skipped == {"caption_too_long": 1, "bad_meta": 2}
    source = open_source(str(table))  # by default lists and objects are simply not meta
    assert [s.meta for s in source] == [{}, {}, {}, {}]
    with pytest.raises(DataError, match="max_caption_chars"):
        open_source(str(table), {"max_caption_chars": "many"})
