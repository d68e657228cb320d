"""Dataset-format sources: parquet tables, img2dataset output, WebDataset shards, idx (MNIST) files."""

import gzip
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from clipkit.app import api
from clipkit.data.shard import ShardSource, open_source
from clipkit.errors import DataError
from clipkit.plugins.sources import parquet_reader
from clipkit.plugins.sources.dataset_sources import Img2DatasetSource, WebDatasetSource
from clipkit.plugins.sources.file_sources import TableSource
from clipkit.plugins.sources.idx_source import IdxSource
from clipkit.plugins.sources.synthetic_shapes import SyntheticShapes, zero_shot_labels


def png(colour: tuple[int, int, int], size: int = 4) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def jpeg(colour: tuple[int, int, int], size: int = 8) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buffer, format="JPEG")
    return buffer.getvalue()


def write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return path


def write_tar(path: Path, members: list[tuple[str, bytes | str]]) -> Path:
    """A tar (gzipped when the name says so) holding ``members`` in this order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz" if path.name.endswith(("gz", "tgz")) else "w") as tar:
        for name, data in members:
            data = data if isinstance(data, bytes) else data.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def round_trip(uri: str, out: Path, **options):
    """Samples read directly from ``uri``, and the same samples read back after ``api.shard``."""
    direct = list(open_source(uri, options))
    manifest = api.shard(uri, out, samples_per_shard=3, options=options)
    assert manifest["n"] == len(direct)
    back = list(ShardSource(out))
    for index, (original, copy) in enumerate(zip(direct, back, strict=True)):
        assert copy.image == original.image and copy.image_ext == original.image_ext
        assert copy.key == original.key and copy.captions == original.captions
        assert copy.meta == {"index": index, **original.meta}  # a new global index: re-indexed
    return direct, manifest


# --------------------------------------------------------------------------------------------
# Parquet tables (TableSource's parquet row reader)


@pytest.fixture
def pq():
    return pytest.importorskip("pyarrow.parquet")


def write_parquet(path: Path, columns: dict, **kwargs) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, **kwargs)
    return path


def test_parquet_table_paths_captions_meta_in_order(pq, tmp_path, monkeypatch):
    """Paths (relative, absolute), caption lists, scalar meta; several row groups read in small batches."""
    import datetime

    monkeypatch.setattr(parquet_reader, "PARQUET_BATCH_ROWS", 2)  # batches inside row groups of 3
    images = [write(tmp_path / "data/img" / f"{i}.png", png((i, 0, 0))) for i in range(6)]
    paths = [f"img/{i}.png" for i in range(5)] + [str(images[5])]
    path = write_parquet(
        tmp_path / "data/t.parquet",
        {
            "image": paths,
            "captions": [[f"photo {i}", f"picture {i}"] for i in range(6)],
            "width": list(range(6)),
            "score": [0.5 * i for i in range(6)],
            "taken": [datetime.date(2020, 1, 1 + i) for i in range(6)],
            "tags": [["x"]] * 6,
        },
        row_group_size=3,
    )
    source = open_source(str(path))
    assert isinstance(source, TableSource) and len(source) == 6
    samples = list(source)
    assert [s.key for s in samples] == [str(i) for i in range(6)]
    assert [s.image for s in samples] == [p.read_bytes() for p in images]
    assert samples[4].captions == ("photo 4", "picture 4")
    # Dates become ISO strings (JSON-able scalar meta); a list column is not meta unless named.
    assert samples[4].meta == {"width": 4, "score": 2.0, "taken": "2020-01-05"}
    assert source.info()["skipped"] == {}


def test_parquet_binary_and_hf_image_columns(pq, tmp_path):
    """The image cell may be the encoded image: a binary column, or HF datasets' {bytes, path} struct."""
    images = [png((10, 20, 30)), jpeg((200, 0, 0))]
    path = write_parquet(tmp_path / "bin.parquet", {"jpg": images, "txt": ["one", "two"], "n": [1, 2]})
    samples = list(open_source(f"{path}?image=jpg&caption=txt"))
    assert [(s.image, s.image_ext, s.captions, s.meta) for s in samples] == [
        (images[0], "png", ("one",), {"n": 1}),  # the extension comes from the bytes, not the column
        (images[1], "jpg", ("two",), {"n": 2}),
    ]
    write(tmp_path / "on_disk.png", png((1, 2, 3)))
    hf = [{"bytes": images[0], "path": "a.png"}, {"bytes": None, "path": "on_disk.png"}]
    path = write_parquet(tmp_path / "hf.parquet", {"image": hf, "caption": ["embedded", "by path"]})
    samples = list(open_source(str(path)))
    assert [s.image for s in samples] == [images[0], (tmp_path / "on_disk.png").read_bytes()]
    assert [s.meta for s in samples] == [{}, {}]


def corrupt_row_group(path: Path, group: int) -> None:
    """Overwrite the first column chunk of row group ``group`` (its page header) with garbage."""
    import pyarrow.parquet as pq

    chunk = pq.ParquetFile(path).metadata.row_group(group).column(0)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    raw = bytearray(path.read_bytes())
    raw[start : start + chunk.total_compressed_size] = b"\xff" * chunk.total_compressed_size
    path.write_bytes(bytes(raw))


def test_parquet_bad_rows_are_counted_and_strict_names_the_row(pq, tmp_path):
    good = png((5, 5, 5))
    rows = [
        (good, "fine", 1.0),
        (b"not an image", "x", 1.0),  # bad_image
        (None, "x", 1.0),  # missing_image
        (good, "   ", 1.0),  # empty_caption
        (good, "x", float("nan")),  # bad_meta: NaN is not JSON
        (good, "also fine", 2.0),
        (good, "lost", 1.0),  # rows 6-8: an unreadable row group -> bad_row each
        (good, "lost", 1.0),
        (good, "lost", 1.0),
    ]
    columns = {"image": [r[0] for r in rows], "caption": [r[1] for r in rows], "w": [r[2] for r in rows]}
    path = write_parquet(tmp_path / "bad.parquet", columns, row_group_size=6, compression="NONE")
    corrupt_row_group(path, 1)
    source = open_source(str(path))
    assert [(s.key, s.captions) for s in source] == [("0", ("fine",)), ("5", ("also fine",))]
    expected = {"bad_image": 1, "missing_image": 1, "empty_caption": 1, "bad_meta": 1, "bad_row": 3}
    assert source.skipped == expected and len(source) == 9
    with pytest.raises(DataError, match=r"bad\.parquet: row 1: bad_image"):
        list(open_source(str(path), {"strict": "true"}))


def test_parquet_errors_name_the_file(pq, tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "t.parquet", {"file": ["a.png"], "caption": ["a"]})
    with pytest.raises(DataError, match=r"t\.parquet: missing column\(s\) nope"):
        open_source(f"{path}?caption=nope")
    with pytest.raises(DataError, match="table not found"):
        open_source(str(tmp_path / "absent.parquet"))
    write(tmp_path / "fake.parquet", "image,caption\n")
    with pytest.raises(DataError, match=r"fake\.parquet: not a readable parquet file"):
        open_source(str(tmp_path / "fake.parquet"))
    monkeypatch.setitem(__import__("sys").modules, "pyarrow.parquet", None)  # as if not installed
    with pytest.raises(DataError, match=r"pyarrow, or pip install 'clipkit-contrastive\[parquet\]'"):
        open_source(str(path))


def test_parquet_reads_only_the_columns_in_use_when_meta_is_named(pq, tmp_path, monkeypatch):
    write(tmp_path / "a.png", png((1, 1, 1)))
    path = write_parquet(
        tmp_path / "t.parquet",
        {"image": ["a.png"], "caption": ["c"], "k": [3], "embedding": [[0.1] * 512], "other": ["x"]},
    )
    read = []
    original = parquet_reader.parquet_records

    def spy(path, columns=None):
        read.append(columns)
        return original(path, columns)

    monkeypatch.setattr(parquet_reader, "parquet_records", spy)
    (sample,) = open_source(f"{path}?meta=k")
    assert sample.meta == {"k": 3} and read[-1] == ["image", "caption", "k"]
    (sample,) = open_source(str(path))
    assert sample.meta == {"k": 3, "other": "x"} and read[-1] is None


def test_parquet_round_trip(pq, tmp_path):
    images = [png((i, 9, 9)) for i in range(4)]
    path = write_parquet(
        tmp_path / "t.parquet", {"image": images, "caption": list("abcd"), "i": [0, 1, 2, 3]}
    )
    direct, manifest = round_trip(str(path), tmp_path / "shards")
    assert len(direct) == 4 and manifest["info"]["name"] == "table"


# --------------------------------------------------------------------------------------------
# img2dataset output


def img2dataset_output(root: Path, output_format: str, shards: list[list[dict]]) -> list:
    """Write ``shards`` the way img2dataset's writers lay them out; returns the expected samples as
    (key, image, captions, meta) for those that downloaded.

    Each sample dict: url, caption (None allowed), licence, and image (bytes) or error (a failed
    download). Keys are img2dataset's: 5-digit shard id + 4-digit index (10 000 samples a shard).
    Per shard: ``NNNNN_stats.json``; "files": ``NNNNN/KEY.jpg/.txt/.json`` + ``NNNNN.parquet``
    (meta of every sample); "webdataset": ``NNNNN.tar`` (``KEY.jpg/.txt/.json``) + ``NNNNN.parquet``;
    "parquet": ``NNNNN.parquet`` with the meta columns, ``caption`` and the ``jpg`` bytes (null when
    the download failed; img2dataset keeps no ``txt`` column there).
    """
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        pa = pq = None
    expected = []
    root.mkdir(parents=True, exist_ok=True)
    for shard_id, samples in enumerate(shards):
        name = f"{shard_id:05d}"
        metas, images = [], []
        for index, spec in enumerate(samples):
            ok = spec.get("image") is not None
            size = Image.open(io.BytesIO(spec["image"])).size if ok else (None, None)
            meta = {
                "url": spec["url"],
                "caption": spec["caption"],
                "licence": spec["licence"],
                "tags": ["a", "b"],  # an extra list column: not scalar, so not meta
                "key": f"{name}{index:04d}",
                "status": "success" if ok else "failed_to_download",
                "error_message": None if ok else spec["error"],
                "width": size[0],
                "height": size[1],
                "original_width": size[0] and size[0] * 2,
                "original_height": size[1] and size[1] * 2,
            }
            metas.append(meta)
            images.append(spec.get("image"))
            if ok and (spec["caption"] or "").strip():
                kept = {k: v for k, v in meta.items() if k not in ("caption", "tags")}
                expected.append((meta["key"], spec["image"], (spec["caption"].strip(),), kept))
        members = []
        for meta, image in zip(metas, images, strict=True):
            if image is not None:
                caption = "" if meta["caption"] is None else str(meta["caption"])
                members += [(f"{meta['key']}.jpg", image), (f"{meta['key']}.txt", caption)]
                members.append((f"{meta['key']}.json", json.dumps(meta, indent=4)))
        if output_format == "files":
            for member, data in members:
                write(root / name / member, data)
        elif output_format == "webdataset":
            write_tar(root / f"{name}.tar", members)
        columns = {key: [meta[key] for meta in metas] for key in metas[0]}
        if output_format == "parquet":
            write_parquet(root / f"{name}.parquet", {**columns, "jpg": pa.array(images, pa.binary())})
        elif pq is not None:
            write_parquet(root / f"{name}.parquet", columns)  # img2dataset's meta-only parquet
        failures = [meta["error_message"] for meta in metas if meta["status"] != "success"]
        stats = {
            "count": len(metas),
            "successes": len(metas) - len(failures),
            "failed_to_download": len(failures),
            "failed_to_resize": 0,
            "duration": 1.5,
            "status_dict": {
                "success": len(metas) - len(failures),
                **{e: failures.count(e) for e in failures},
            },
        }
        write(root / f"{name}_stats.json", json.dumps(stats, indent=4))
    return expected


def img2dataset_shards_spec() -> list[list[dict]]:
    return [
        [
            {
                "url": "http://x/0.jpg",
                "caption": "a red square",
                "licence": "cc-by",
                "image": jpeg((255, 0, 0)),
            },
            {"url": "http://x/1.jpg", "caption": "gone", "licence": "cc0", "error": "HTTP 404"},
            {"url": "http://x/2.jpg", "caption": None, "licence": "cc0", "image": jpeg((0, 9, 0))},
            {"url": "http://x/3.png", "caption": " a blue one ", "licence": "cc0", "image": png((0, 0, 255))},
        ],
        [
            {"url": "http://y/0.jpg", "caption": "timed out", "licence": "cc0", "error": "timeout"},
            {"url": "http://y/1.jpg", "caption": "green", "licence": "pd", "image": jpeg((0, 255, 0))},
        ],
    ]


@pytest.mark.parametrize("output_format", ["files", "webdataset", "parquet"])
def test_img2dataset_output_formats(output_format, tmp_path):
    if output_format == "parquet":
        pytest.importorskip("pyarrow")
    root = tmp_path / "out"
    expected = img2dataset_output(root, output_format, img2dataset_shards_spec())
    for uri in (f"img2dataset:{root}", str(root)):  # a bare folder with *_stats.json is detected
        source = open_source(uri)
        assert isinstance(source, Img2DatasetSource)
        samples = list(source)
        assert [(s.key, s.image, s.captions, dict(s.meta)) for s in samples] == expected
        assert [s.key for s in samples] == ["000000000", "000000003", "000010001"]
        assert samples[0].meta["url"] == "http://x/0.jpg" and samples[0].meta["original_width"] == 16
        assert [s.image_ext for s in samples] == ["jpg", "png", "jpg"]  # named by the bytes
        # Two failed downloads (counted from the stats or the parquet rows), one empty caption.
        assert source.skipped == {"failed_download": 2, "empty_caption": 1}
        assert len(source) == 6
        assert source.info()["formats"] == [output_format] and source.info()["shards"] == 2


@pytest.mark.parametrize("output_format", ["files", "webdataset", "parquet"])
def test_img2dataset_strict_names_the_failure(output_format, tmp_path):
    if output_format == "parquet":
        pytest.importorskip("pyarrow")
    root = tmp_path / "out"
    img2dataset_output(root, output_format, img2dataset_shards_spec()[1:])  # failure first in parquet
    from_stats = (
        r"00000_stats\.json: failed sample 1: failed_download: 1 of 2 samples failed in img2dataset; "
    )
    message = {
        "files": from_stats + r"most common errors: timeout \(1\)",
        "webdataset": from_stats + r"most common errors: timeout \(1\)",
        "parquet": r"00000\.parquet: row 0 \(key 000000000\): failed_download: .*status "
        r"'failed_to_download' \(timeout\)",
    }[output_format]
    with pytest.raises(DataError, match=message):
        list(open_source(f"img2dataset:{root}", {"strict": True}))


def test_img2dataset_bad_samples_and_errors(tmp_path):
    root = tmp_path / "out"
    img2dataset_output(
        root, "files", [[{"url": "u", "caption": "ok", "licence": "l", "image": jpeg((1, 1, 1))}]]
    )
    folder = root / "00000"
    write(folder / "000000007.jpg", b"\xff\xd8 truncated jpeg")  # bad_image
    write(folder / "000000007.txt", "x")
    write(folder / "000000008.jpg", jpeg((2, 2, 2)))
    write(folder / "000000008.txt", b"caf\xe9")  # bad_encoding
    write(folder / "000000009.jpg", jpeg((3, 3, 3)))
    write(folder / "000000009.json", "{not json")  # bad_meta
    source = open_source(str(root))
    assert [s.key for s in source] == ["000000000"]
    assert source.skipped == {"bad_image": 1, "bad_encoding": 1, "bad_meta": 1}
    with pytest.raises(DataError, match="not a directory"):
        open_source(f"img2dataset:{tmp_path / 'absent'}")
    with pytest.raises(DataError, match="no img2dataset shards"):
        open_source(f"img2dataset:{folder}")
    write(tmp_path / "tf/00000.tfrecord", b"")
    with pytest.raises(DataError, match="tfrecord output is not supported"):
        open_source(f"img2dataset:{tmp_path / 'tf'}")


def test_img2dataset_round_trip(tmp_path):
    root = tmp_path / "out"
    img2dataset_output(root, "webdataset", img2dataset_shards_spec())
    direct, manifest = round_trip(f"img2dataset:{root}", tmp_path / "shards")
    assert len(direct) == 3 and manifest["info"]["skipped"] == {"empty_caption": 1, "failed_download": 2}


# --------------------------------------------------------------------------------------------
# WebDataset shards, re-indexed


def test_real_webdataset_sample_shard(shared_data, tmp_path):
    """webdataset's own test shard: 90 samples of .png + .cls (no captions: a label-only set)."""
    path = shared_data / "webdataset-sample" / "sample.tgz"
    with tarfile.open(path) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    keys = sorted({name.split(".")[0] for name in files}, key=lambda k: list(files).index(f"{k}.png"))
    source = open_source(f"webdataset:{path}")
    assert isinstance(source, WebDatasetSource)
    samples = list(source)
    assert len(samples) == 90 and source.skipped == {}
    assert [s.key for s in samples] == keys
    assert [s.meta["label"] for s in samples] == [int(files[f"{k}.cls"]) for k in keys]
    assert [s.image for s in samples] == [files[f"{k}.png"] for k in keys]
    assert all(s.captions == () and s.image_ext == "png" for s in samples)
    _, manifest = round_trip(f"webdataset:{path}", tmp_path / "shards")
    assert manifest["n"] == 90


@pytest.fixture
def shards(tmp_path):
    """Two shards, one gzipped: json meta and captions lists, cls labels, txt captions."""
    a = [
        ("s0/a.png", png((1, 0, 0))),
        ("s0/a.txt", "first caption"),
        ("s0/a.json", json.dumps({"score": 0.5, "source": "cam", "nested": {"x": 1}})),
        ("s0/a.cls", "3"),
        ("b.jpg", jpeg((0, 1, 0))),
        ("b.txt", "only txt"),
        ("b.json", json.dumps({"captions": ["one of two", "two of two"], "w": 8})),  # wins over txt
    ]
    b = [("c.PNG", png((0, 0, 1))), ("c.cls", " 1\n"), ("__index__", b"meta data, not a sample")]
    write_tar(tmp_path / "shards/shard-000.tar", a)
    write_tar(tmp_path / "shards/shard-001.tar.gz", b)
    return tmp_path / "shards"


def test_webdataset_shards_fields_and_shard_lists(shards, tmp_path):
    expected = [
        ("s0/a", ("first caption",), {"score": 0.5, "source": "cam", "label": 3}),
        ("b", ("one of two", "two of two"), {"w": 8}),
        ("c", (), {"label": 1}),  # no caption field: allowed, no captions
    ]
    for spec in (str(shards), f"{shards}/shard-*", f"{shards}/shard-000.tar::{shards}/shard-001.tar.gz"):
        samples = list(open_source(f"webdataset:{spec}"))
        assert [(s.key, s.captions, s.meta) for s in samples] == expected
        assert [s.image_ext for s in samples] == ["png", "jpg", "png"]
    write_tar(tmp_path / "more/part-0.tar", [("x.png", png((9, 9, 9))), ("x.txt", "x")])
    write_tar(tmp_path / "more/part-1.tar", [("y.png", png((8, 8, 8))), ("y.txt", "y")])
    source = open_source(f"webdataset:{tmp_path}/more/part-{{0..1}}.tar")  # webdataset's brace expansion
    assert [s.key for s in source] == ["x", "y"] and source.info()["shards"] == 2


def test_webdataset_bad_samples_are_counted(tmp_path):
    good = png((4, 4, 4))
    members = [
        ("ok.png", good),
        ("ok.txt", "fine"),
        ("noimage.txt", "x"),  # missing_image
        ("junk.png", b"junk"),  # bad_image
        ("meta.png", good),
        ("meta.json", "[1, 2]"),  # bad_meta
        ("label.png", good),
        ("label.cls", "cat"),  # bad_meta
        ("blank.png", good),
        ("blank.txt", "  \n"),  # empty_caption
        ("latin.png", good),
        ("latin.txt", b"caf\xe9"),  # bad_encoding
        ("twice.png", good),
        ("twice.png", good),  # bad_sample
        ("last.png", png((5, 5, 5), size=64)),
        ("last.txt", "kept"),
        ("cut.png", png((6, 6, 6), size=64)),  # truncated below -> bad_shard
    ]
    path = write_tar(tmp_path / "bad.tar", members)
    raw = path.read_bytes()
    path.write_bytes(raw[: raw.index(b"cut.png") + 512 + 40])  # inside cut.png's data
    write_tar(tmp_path / "next.tar", [("after.png", good), ("after.txt", "next shard still read")])
    source = open_source(f"webdataset:{tmp_path}/{{bad,next}}.tar")
    assert [s.key for s in source] == ["ok", "last", "after"]
    assert source.skipped == {
        "missing_image": 1,
        "bad_image": 1,
        "bad_meta": 2,
        "empty_caption": 1,
        "bad_encoding": 1,
        "bad_sample": 1,
        "bad_shard": 1,
    }
    with pytest.raises(DataError, match=r"bad\.tar: noimage: missing_image"):
        list(open_source(f"webdataset:{tmp_path}/bad.tar", {"strict": "1"}))


def test_webdataset_missing_shards_are_named(tmp_path):
    write_tar(tmp_path / "s-0.tar", [("a.png", png((1, 1, 1)))])
    with pytest.raises(DataError, match=r"s-1\.tar: WebDataset shard not found"):
        open_source(f"webdataset:{tmp_path}/s-{{0..2}}.tar")
    with pytest.raises(DataError, match=r"absent\.tar: WebDataset shard not found"):
        open_source(f"webdataset:{tmp_path}/absent.tar")
    with pytest.raises(DataError, match="no file matches"):
        open_source(f"webdataset:{tmp_path}/none-*.tar")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .tar/.tgz/.tar.gz files"):
        open_source(f"webdataset:{tmp_path / 'empty'}")


def test_webdataset_round_trip_gives_new_indices(shards, tmp_path):
    direct, manifest = round_trip(f"webdataset:{shards}", tmp_path / "out", workers="2")
    assert [s.key for s in direct] == ["s0/a", "b", "c"] and manifest["info"]["shards"] == 2


def test_a_gzip_tar_named_tar_is_read_by_the_webdataset_source_and_refused_by_the_loader(tmp_path):
    """``webdataset:`` reads compressed tars (it writes plain ones); the loader reads plain tars only,
    so a folder or list holding a gzip-compressed ``.tar`` is refused before anything is read,
    naming the file and the command that reads it (it was a `corrupt_tar` once training ran)."""
    from clipkit.data.shard_sets import resolve

    write_tar(tmp_path / "in/a.tar", [("a.png", png((1, 0, 0))), ("a.txt", "plain")])
    write_tar(tmp_path / "in/b.tar.gz", [("b.png", png((0, 1, 0))), ("b.txt", "gzipped")])
    (tmp_path / "in/b.tar.gz").rename(tmp_path / "in/b.tar")
    said = r"b\.tar is a gzip-compressed tar.*clipkit shard webdataset:"
    with pytest.raises(DataError, match=said):
        resolve(str(tmp_path / "in"))
    with pytest.raises(DataError, match=said):
        resolve(f"{tmp_path}/in/{{a,b}}.tar")
    refused = shard_cli(tmp_path / "in", tmp_path / "streamed")  # a bare folder: read as the loader reads it
    assert refused.exit_code == 2 and "b.tar is a gzip-compressed tar" in refused.output, refused.output
    assert not (tmp_path / "streamed").exists()
    result = shard_cli(f"webdataset:{tmp_path / 'in'}", tmp_path / "out")
    assert result.exit_code == 0 and "wrote 2 samples" in result.output, result.output
    assert resolve(str(tmp_path / "out")).num_samples == 2  # what it wrote, the loader reads


def mixed_caption_tars(root: Path) -> Path:
    """Four samples in two tars; "c" (the third) has a label and no caption field."""
    write_tar(root / "part-0.tar", [("a.png", png((1, 0, 0))), ("a.txt", "red"), ("b.png", png((0, 1, 0))),
                                    ("b.txt", "green")])  # fmt: skip
    write_tar(root / "part-1.tar", [("c.png", png((0, 0, 1))), ("c.cls", "1"), ("d.png", png((2, 2, 2))),
                                    ("d.txt", "grey")])  # fmt: skip
    return root


def shard_cli(*args: str):
    from typer.testing import CliRunner

    from clipkit.app.cli import make_app
    from clipkit.contract.manager import make_plugin_manager

    return CliRunner().invoke(make_app(make_plugin_manager(autoload=False)), ["shard", *map(str, args)])


# Both ways `clipkit shard` reads tars: re-indexed by the webdataset: source, and a bare folder of tars.
@pytest.mark.parametrize("form", ["webdataset:{}", "{}"])
def test_caption_less_samples_of_a_captioned_set_are_counted_and_warned(tmp_path, form):
    """Kept (label-only samples are allowed), but counted in the manifest and said at shard time:
    training a text tower on the set stops at them, long after sharding."""
    result = shard_cli(form.format(mixed_caption_tars(tmp_path / "in")), tmp_path / "out")
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "out/manifest.json").read_text())
    assert manifest["n"] == 4  # nothing dropped
    assert manifest["info"]["uncaptioned"] == 1
    assert manifest["info"]["uncaptioned_example"] == {"index": 2, "key": "c"}
    warnings = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "1 of 4 samples have no caption" in warnings[0], result.output
    assert "'c'" in warnings[0] and "text tower" in warnings[0]


def test_a_label_only_set_is_counted_without_a_warning(tmp_path):
    write_tar(tmp_path / "in/x.tar", [("a.png", png((1, 0, 0))), ("a.cls", "0"), ("b.png", png((0, 1, 0)))])
    result = shard_cli(f"webdataset:{tmp_path / 'in'}", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "out/manifest.json").read_text())["info"]["uncaptioned"] == 2
    assert "warning" not in result.output  # an evaluation set: nothing to warn about


def test_caption_less_count_survives_an_interrupted_run(tmp_path, capsys):
    from clipkit.data.shard_writer import ensure_shards

    source = f"webdataset:{mixed_caption_tars(tmp_path / 'in')}"
    seen = []

    def stop_after_three(count):  # c (index 2) is in the third one-sample shard, finished
        seen.append(count)
        if sum(seen) > 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        api.shard(source, tmp_path / "out", samples_per_shard=1, progress=stop_after_three)
    manifest = api.shard(source, tmp_path / "out", samples_per_shard=1)
    assert manifest["info"]["uncaptioned"] == 1 and manifest["info"]["uncaptioned_example"]["key"] == "c"
    # Sharded for `clipkit train` (data.source): the same warning, on stderr.
    ensure_shards(str(tmp_path / "train"), source)
    assert "warning: 1 of 4 samples have no caption" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# idx files (MNIST layout)


def idx_bytes(array: np.ndarray) -> bytes:
    """LeCun's idx format: 00 00 08 <rank>, big-endian uint32 sizes, the unsigned bytes."""
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    return header + array.astype(np.uint8).tobytes()


@pytest.fixture
def idx_set(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(5, 7, 6), dtype=np.uint8)  # 7 rows x 6 columns
    labels = np.array([2, 0, 1, 2, 1], dtype=np.uint8)
    write(tmp_path / "gz/train-images-idx3-ubyte.gz", gzip.compress(idx_bytes(images)))
    write(tmp_path / "gz/train-labels-idx1-ubyte.gz", gzip.compress(idx_bytes(labels)))
    write(tmp_path / "gz/classes.json", json.dumps({"classes": ["cat", "dog", "T-shirt/top"], "source": "x"}))
    write(tmp_path / "raw/train-images-idx3-ubyte", idx_bytes(images))
    write(tmp_path / "raw/other-labels.bin", idx_bytes(labels))
    return tmp_path, images, labels


def test_idx_images_labels_classes(idx_set):
    root, images, labels = idx_set
    source = open_source(f"idx:{root}/gz/train-images-idx3-ubyte.gz")
    assert isinstance(source, IdxSource) and len(source) == 5
    samples = list(source)
    for sample, image, label in zip(samples, images, labels, strict=True):
        decoded = Image.open(io.BytesIO(sample.image))
        assert sample.image_ext == "png" and decoded.format == "PNG" and decoded.mode == "L"
        assert np.array_equal(np.asarray(decoded), image)  # lossless, rows x columns kept
        name = ["cat", "dog", "T-shirt/top"][label]
        assert sample.meta == {"label": int(label), "class": name} and sample.captions == (
            f"a photo of a {name}.",
        )
    assert [s.key for s in samples] == ["0", "1", "2", "3", "4"]
    labels_info = source.info()["labels"]
    assert labels_info == {
        "class": {"classes": ["cat", "dog", "T-shirt/top"], "templates": ["a photo of a {}."]}
    }
    reference = zero_shot_labels(SyntheticShapes(n=1).combos)  # the layout zero-shot eval reads
    assert all(set(entry) == set(labels_info["class"]) for entry in reference.values())
    # Raw (not gzipped) files, labels named explicitly, no classes.json: the digits.
    source = open_source(f"{root}/raw/train-images-idx3-ubyte?labels={root}/raw/other-labels.bin")
    assert [s.meta["class"] for s in source] == ["2", "0", "1", "2", "1"]
    assert source.info()["labels"]["class"]["classes"] == [str(d) for d in range(10)]


def test_idx_validation_names_the_file(idx_set):
    root, images, labels = idx_set
    raw = root / "raw"
    cases = {
        "bad-images-idx3-ubyte": (b"\x08\x03\x00\x00" + bytes(20), r"bad-images-idx3-ubyte: not an idx file"),
        "float-images-idx3-ubyte": (b"\x00\x00\x0d\x03" + bytes(12), r"element type 0x0d is not supported"),
        "rank-images-idx3-ubyte": (idx_bytes(labels), r"rank-images-idx3-ubyte: an idx file of rank 1"),
        "cut-images-idx3-ubyte": (
            idx_bytes(images)[:-1],
            r"cut-images-idx3-ubyte: the header says 5×7×6 = 210",
        ),
        "gz-images-idx3-ubyte": (gzip.compress(idx_bytes(images))[:-9], r"gz-images-idx3-ubyte: broken gzip"),
    }
    for name, (data, message) in cases.items():
        write(raw / name, data)
        write(raw / name.replace("images-idx3", "labels-idx1"), idx_bytes(labels))
        with pytest.raises(DataError, match=message):
            open_source(f"idx:{raw / name}")
    write(raw / "few-images-idx3-ubyte", idx_bytes(images))
    write(raw / "few-labels-idx1-ubyte", idx_bytes(labels[:4]))
    with pytest.raises(
        DataError, match=r"few-images-idx3-ubyte holds 5 images but .*few-labels-idx1-ubyte holds 4"
    ):
        open_source(f"idx:{raw / 'few-images-idx3-ubyte'}")
    with pytest.raises(DataError, match=r"train-labels-idx1-ubyte not found; add \?labels=PATH"):
        open_source(f"idx:{raw / 'train-images-idx3-ubyte'}")
    with pytest.raises(DataError, match="idx images file not found"):
        open_source(f"idx:{raw / 'absent-images-idx3-ubyte'}")
    write(root / "gz/classes.json", json.dumps(["only", "two"]))
    with pytest.raises(DataError, match=r"classes\.json names 2 classes but the labels go up to 2"):
        open_source(f"idx:{root}/gz/train-images-idx3-ubyte.gz")
    with pytest.raises(DataError, match="unknown query parameter 'colour'"):
        open_source(f"idx:{root}/gz/train-images-idx3-ubyte.gz?colour=red")


def test_idx_round_trip(idx_set, tmp_path):
    root, _, _ = idx_set
    direct, manifest = round_trip(f"idx:{root}/gz/train-images-idx3-ubyte.gz", tmp_path / "shards")
    assert len(direct) == 5 and manifest["info"]["labels"]["class"]["classes"][2] == "T-shirt/top"


def parse_idx(path: Path) -> np.ndarray:
    """A direct parse of a gzipped idx file, independent of the source's reader."""
    raw = gzip.decompress(path.read_bytes())
    rank = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(rank)]
    return np.frombuffer(raw[4 + 4 * rank :], dtype=np.uint8).reshape(shape)


def test_real_mnist_test_set(shared_data):
    folder = shared_data / "mnist"
    pixels = parse_idx(folder / "t10k-images-idx3-ubyte.gz")
    labels = parse_idx(folder / "t10k-labels-idx1-ubyte.gz")
    source = open_source(f"idx:{folder}/t10k-images-idx3-ubyte.gz")
    assert len(source) == 10_000 and pixels.shape == (10_000, 28, 28)
    seen = np.zeros(10, dtype=int)
    for index, sample in enumerate(source):
        seen[sample.meta["label"]] += 1
        if index in (0, 1234, 9999):
            decoded = np.asarray(Image.open(io.BytesIO(sample.image)))
            assert np.array_equal(decoded, pixels[index]) and sample.meta["label"] == labels[index]
    assert seen.tolist() == np.bincount(labels, minlength=10).tolist()
    assert int(labels[0]) == 7 and source.info()["n"] == 10_000  # MNIST's first test digit is a 7


def test_real_fashion_mnist_class_names(shared_data):
    folder = shared_data / "fashion-mnist"
    names = json.loads((folder / "classes.json").read_text(encoding="utf-8"))["classes"]
    source = open_source(f"{folder}/t10k-images-idx3-ubyte.gz")  # a bare idx path is recognised
    assert source.info()["labels"]["class"]["classes"] == names
    first = next(iter(source))
    label = int(parse_idx(folder / "t10k-labels-idx1-ubyte.gz")[0])
    assert first.meta == {"label": label, "class": names[label]}
    assert first.captions == (f"a photo of a {names[label]}.",)


@pytest.mark.parametrize("output_format", ["files", "webdataset"])
def test_img2dataset_resume_continues_where_it_stopped(output_format, tmp_path):
    """state()/restore() (resumable ``clipkit shard``): candidates come in a stable order, failures too."""
    root = tmp_path / "out"
    img2dataset_output(root, output_format, img2dataset_shards_spec())
    whole = [s.key for s in open_source(str(root))]
    first = open_source(str(root))
    iterator = iter(first)
    head = [next(iterator).key for _ in range(2)]
    resumed = open_source(str(root))
    resumed.restore(first.state())
    assert head + [s.key for s in resumed] == whole
    assert resumed.skipped == {"failed_download": 2, "empty_caption": 1}
