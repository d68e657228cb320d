"""Local-file sources: JSONL/CSV/TSV tables, caption folders, class folders; bad rows skipped or strict."""

import io
import json
from pathlib import Path

import pytest
from PIL import Image

from clipkit.app import api
from clipkit.data.shard import ShardSource, open_source, read_manifest
from clipkit.errors import DataError
from clipkit.plugins.sources.file_sources import (
    CaptionFolderSource,
    ClassFolderSource,
    TableSource,
    open_file_source,
)
from clipkit.plugins.sources.synthetic_shapes import SyntheticShapes, zero_shot_labels


def png(colour: tuple[int, int, int], size: int = 4) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def jpeg(colour: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buffer, format="JPEG")
    return buffer.getvalue()


def write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return path


def jsonl(path: Path, rows: list) -> Path:
    return write(path, "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


@pytest.fixture
def table(tmp_path):
    """A JSONL table: relative and absolute paths, a 5-caption row, meta of several JSON types."""
    images = {
        "a": write(tmp_path / "data/img/a.png", png((255, 0, 0))),
        "b": write(tmp_path / "data/img/b.jpg", jpeg((0, 255, 0))),
        "c": write(tmp_path / "elsewhere/c.png", png((0, 0, 255))),
    }
    rows = [
        {
            "image": "img/a.png",
            "caption": "a red square",
            "width": 4,
            "score": 0.5,
            "ok": True,
            "tags": ["x"],
        },
        {"image": "img/b.jpg", "captions": [f"green {i}" for i in range(5)], "width": 8, "source": "cam"},
        {"image": str(images["c"]), "caption": "  blue  ", "width": 4, "note": None},
    ]
    return jsonl(tmp_path / "data/captions.jsonl", rows), images


def test_jsonl_table_captions_meta_and_paths(table):
    path, images = table
    source = open_source(str(path))
    assert isinstance(source, TableSource) and len(source) == 3
    samples = list(source)
    assert [s.key for s in samples] == ["0", "1", "2"]
    assert [s.image for s in samples] == [images[k].read_bytes() for k in "abc"]
    assert [s.image_ext for s in samples] == ["png", "jpg", "png"]
    assert samples[0].captions == ("a red square",)
    assert samples[1].captions == tuple(f"green {i}" for i in range(5))
    assert samples[2].captions == ("blue",)  # stripped; the absolute path was used as is
    # Numbers stay numbers; lists are not meta unless asked for; the image/caption columns are not meta.
    assert samples[0].meta == {"width": 4, "score": 0.5, "ok": True}
    assert samples[1].meta == {"width": 8, "source": "cam"}
    assert samples[2].meta == {"width": 4, "note": None}
    assert source.info()["skipped"] == {} and source.info()["n"] == 3


def test_query_selects_columns(tmp_path):
    write(tmp_path / "p.png", png((1, 2, 3)))
    rows = [{"file": "p.png", "t1": "one", "t2": ["two", "three"], "k": 1, "tags": ["a", "b"], "x": 2}]
    path = jsonl(tmp_path / "t.jsonl", rows)
    (sample,) = open_source(f"{path}?image=file&caption=t1,t2&meta=k,tags")
    assert sample.captions == ("one", "two", "three")
    assert sample.meta == {"k": 1, "tags": ["a", "b"]}
    (sample,) = open_source(f"{path}?caption=t1&meta=")  # image defaults to "file"; meta= means none
    assert sample.captions == ("one",) and sample.meta == {}
    with pytest.raises(DataError, match="unknown query parameter 'colour'"):
        open_source(f"{path}?colour=red")


def test_csv_and_tsv_parse_meta_types(tmp_path):
    write(tmp_path / "imgs/a.png", png((9, 9, 9)))
    write(tmp_path / "b.png", png((8, 8, 8)))
    csv_path = write(
        tmp_path / "t.csv",
        'image,caption,label,weight,city\nimgs/a.png,"hello, world",3,0.25,Paris\n'
        f'{tmp_path / "b.png"},42,-1,1e3,"say ""hi"""\n',
    )
    samples = list(open_source(str(csv_path)))
    assert [s.captions for s in samples] == [("hello, world",), ("42",)]  # a caption stays a string
    assert samples[0].meta == {"label": 3, "weight": 0.25, "city": "Paris"}
    assert samples[1].meta == {"label": -1, "weight": 1000.0, "city": 'say "hi"'}
    assert type(samples[0].meta["label"]) is int
    tsv_path = write(tmp_path / "t.tsv", 'path\tcaptions\tn\nb.png\t["first", "second"]\t7\n')
    (sample,) = open_source(str(tsv_path))
    assert sample.captions == ("first", "second") and sample.meta == {"n": 7}
    with pytest.raises(DataError, match="missing column"):
        open_source(f"{csv_path}?caption=nope")


def bad_jsonl(tmp_path) -> Path:
    """Two good rows among one bad row of each kind (comments: the reason each is counted under)."""
    write(tmp_path / "good.png", png((1, 1, 1)))
    write(tmp_path / "junk.png", b"this is not an image")
    write(tmp_path / "cut.png", png((2, 2, 2), size=16)[:40])
    path = tmp_path / "bad.jsonl"
    lines = [
        json.dumps({"image": "good.png", "caption": "fine"}).encode(),
        json.dumps({"image": "absent.png", "caption": "x"}).encode(),  # missing_image
        json.dumps({"caption": "no image column"}).encode(),  # missing_image
        json.dumps({"image": "junk.png", "caption": "x"}).encode(),  # bad_image
        json.dumps({"image": "cut.png", "caption": "x"}).encode(),  # bad_image (truncated)
        json.dumps({"image": "good.png", "caption": "   "}).encode(),  # empty_caption
        json.dumps({"image": "good.png", "captions": []}).encode(),  # empty_caption
        json.dumps({"image": "good.png", "caption": 7}).encode(),  # bad_caption
        b'{"image": "good.png", "caption": "caf\xe9"}',  # bad_encoding (latin-1)
        b'{"image": "good.png", "caption": ',  # bad_line
        b"[1, 2]",  # bad_line
        b"",  # blank lines are not rows
        json.dumps({"image": "good.png", "captions": ["", "second is fine"]}).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_bad_rows_are_skipped_and_counted(tmp_path):
    source = open_source(str(bad_jsonl(tmp_path)))
    assert "skipped" not in source.info()  # not known before iterating
    samples = list(source)
    assert [(s.key, s.captions) for s in samples] == [("0", ("fine",)), ("11", ("second is fine",))]
    expected = {
        "missing_image": 2,
        "bad_image": 2,
        "empty_caption": 2,
        "bad_caption": 1,
        "bad_encoding": 1,
        "bad_line": 2,
    }
    assert source.skipped == expected and len(source) == 12
    assert source.info()["skipped"] == expected and source.info()["n"] == 2
    list(source)  # a second pass counts afresh
    assert source.skipped == expected


def test_bad_csv_rows(tmp_path):
    write(tmp_path / "g.png", png((3, 3, 3)))
    path = write(
        tmp_path / "t.csv",
        b"image,caption,extra\ng.png,ok,1\ng.png,too,many,fields\ng.png,caf\xe9,2\ng.png,,3\nmissing.png,x,4\n",
    )
    source = open_source(str(path))
    assert [s.captions for s in source] == [("ok",)]
    assert source.skipped == {"bad_line": 1, "bad_encoding": 1, "empty_caption": 1, "missing_image": 1}


def test_strict_names_file_and_row(tmp_path):
    path = bad_jsonl(tmp_path)
    with pytest.raises(DataError, match=r"bad\.jsonl: line 2: missing_image: .*absent\.png"):
        list(open_source(str(path), {"strict": True}))
    assert not open_file_source(str(path), {"strict": "false"}).strict
    folder = tmp_path / "folder"
    write(folder / "a.png", png((1, 1, 1)))
    with pytest.raises(DataError, match=r"a\.png: missing_caption"):
        list(open_source(f"folder:{folder}", {"strict": "true"}))


def test_end_to_end_shard_and_read_back(table, tmp_path):
    path, _ = table
    source_samples = list(open_source(str(path)))
    manifest = api.shard(str(path), tmp_path / "shards", samples_per_shard=2)
    assert manifest["n"] == 3 and len(manifest["shards"]) == 2
    assert read_manifest(tmp_path / "shards")["info"]["name"] == "table"
    read = list(ShardSource(tmp_path / "shards"))
    for index, (original, copy) in enumerate(zip(source_samples, read, strict=True)):
        assert copy.image == original.image and copy.image_ext == original.image_ext
        assert copy.captions == original.captions and copy.key == original.key
        assert copy.meta == {"index": index, **original.meta}


def test_caption_folder(tmp_path):
    root = tmp_path / "pics"
    write(root / "one.png", png((10, 0, 0)))
    write(root / "one.txt", "first caption\n\nsecond caption\n")
    write(root / "one.json", json.dumps({"photographer": "ann", "year": 2001}))
    write(root / "sub/two.jpg", jpeg((0, 10, 0)))
    write(root / "sub/two.txt", "only one")
    write(root / "three.png", png((0, 0, 10)))  # missing_caption
    write(root / "four.png", png((5, 5, 5)))
    write(root / "four.txt", b"\xff\xfe bad")  # bad_encoding
    write(root / "five.png", png((6, 6, 6)))
    write(root / "five.txt", "ok")
    write(root / "five.json", "[1, 2]")  # bad_meta
    write(root / "six.png", b"nope")
    write(root / "six.txt", "ok")  # bad_image
    write(root / ".hidden.png", png((7, 7, 7)))
    for uri in (f"folder:{root}", str(root)):  # a bare directory with captioned images is a caption folder
        source = open_source(uri)
        assert isinstance(source, CaptionFolderSource)
        samples = list(source)
        assert [s.key for s in samples] == ["one", "sub/two"]
        assert samples[0].captions == ("first caption", "second caption")
        assert samples[0].meta == {"photographer": "ann", "year": 2001} and samples[1].meta == {}
        assert samples[1].image == (root / "sub/two.jpg").read_bytes() and samples[1].image_ext == "jpg"
        assert source.skipped == {"missing_caption": 1, "bad_encoding": 1, "bad_meta": 1, "bad_image": 1}


def test_shard_directory_is_not_a_caption_folder(tmp_path):
    write(tmp_path / "x.png", png((1, 1, 1)))
    write(tmp_path / "x.txt", "caption")
    write(tmp_path / "manifest.json", "{}")
    assert open_file_source(str(tmp_path)) is None
    assert open_file_source("synthetic://shapes?n=2") is None
    assert isinstance(open_source("synthetic://shapes?n=2"), SyntheticShapes)  # still reaches the built-in


def test_class_folders(tmp_path):
    root = tmp_path / "eval"
    write(root / "sea_lion/1.png", png((1, 0, 0)))
    write(root / "cat/1.png", png((2, 0, 0)))
    write(root / "cat/2.jpg", jpeg((3, 0, 0)))
    write(root / "cat/broken.png", b"no")
    (root / "empty_class").mkdir()
    source = open_source(f"classes:{root}")
    assert isinstance(source, ClassFolderSource)
    samples = list(source)
    assert [(s.key, s.meta["label"], s.meta["class"]) for s in samples] == [
        ("cat/1", 0, "cat"),
        ("cat/2", 0, "cat"),
        ("sea_lion/1", 2, "sea lion"),
    ]
    assert samples[2].captions == ("a photo of a sea lion.",)
    assert source.skipped == {"bad_image": 1}
    labels = source.info()["labels"]
    assert labels == {
        "class": {"classes": ["cat", "empty class", "sea lion"], "templates": ["a photo of a {}."]}
    }
    # Same layout as the synthetic shapes' zero-shot labels, which the zero_shot eval reads.
    reference = zero_shot_labels(SyntheticShapes(n=1).combos)
    assert all(set(entry) == set(labels["class"]) for entry in reference.values())
    with pytest.raises(DataError, match="no class sub-directories"):
        open_source(f"classes:{root / 'empty_class'}")


@pytest.mark.parametrize("name", ["coco-mini-cc-by", "openclipart"])
def test_shared_datasets_shard_completely(name, tmp_path, shared_data):
    path = shared_data / name / "captions.jsonl"
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    manifest = api.shard(str(path), tmp_path / name, samples_per_shard=5000)
    assert manifest["n"] == len(lines)
    if name == "coco-mini-cc-by":
        read = list(ShardSource(tmp_path / name))
        assert [list(s.captions) for s in read] == [row["captions"] for row in lines]
        assert all(len(s.captions) == 5 for s in read)
        assert read[0].meta["coco_id"] == lines[0]["coco_id"]


def test_the_manifest_records_what_was_skipped_and_why(tmp_path):
    """Rows skipped while sharding are counted by reason in manifest.json's source info."""
    Image.new("RGB", (4, 4), (1, 2, 3)).save(tmp_path / "ok.png")
    rows = [
        {"image": "ok.png", "caption": "a pixel"},
        {"image": "missing.png", "caption": "gone"},
        {"image": "ok.png", "caption": ""},
    ]
    table = tmp_path / "t.jsonl"
    table.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    api.shard(str(table), tmp_path / "shards")
    manifest = read_manifest(tmp_path / "shards")
    assert manifest["n"] == 1
    assert manifest["info"]["skipped"] == {"missing_image": 1, "empty_caption": 1}
