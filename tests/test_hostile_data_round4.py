"""Hostile data, round four: what a table, a caption folder, a URI or an idx file says is read as
it says, and what cannot be read is named — never silently swallowed, mangled or kept.

* CSV: strict RFC 4180 quoting; a quote never closed is refused naming its line (it swallowed
  every later row into one cell); TSV is read without quoting (CC3M-style captions keep quotes);
  a header naming a column twice is refused (the last cell won).
* A caption file starting with a UTF-8 byte-order mark loses the mark.
* Bad ``synthetic://`` numbers and empty idx files are one line, not a traceback; a shard sample
  without an image names its members.
"""

from __future__ import annotations

import json

import pytest
import webdataset as wds
from PIL import Image

from clipkit.app import api
from clipkit.errors import DataError


@pytest.fixture
def images(tmp_path):
    for i in range(5):
        Image.new("RGB", (16, 16), (40 * i, 0, 0)).save(tmp_path / f"{i}.png")
    return tmp_path


def captions_of(directory) -> list:
    records = wds.WebDataset(
        sorted(str(p) for p in directory.glob("*.tar")), shardshuffle=False, empty_check=False
    )
    return [json.loads(record["json"])["captions"] for record in records]


@pytest.mark.parametrize(
    "text, message",
    [  # a quote never closed swallowed every later row into one cell; a repeated column kept its last
        ('image,caption,extra\n0.png,first,1\n1.png,second,"2\n2.png,third,3\n3.png,fourth,4\n',
         r"t.csv: line 3: a quoted field opened here is never closed"),
        ("image,caption,caption\n0.png,first caption,second caption\n",
         r"names column\(s\) \['caption'\] more than once"),
    ],
)  # fmt: skip
def test_a_csv_that_cannot_be_read_as_written_is_refused_naming_why(images, text, message):
    table = images / "t.csv"
    table.write_text(text)
    with pytest.raises(DataError, match=message):
        api.shard(str(table), images / "out")


def test_csv_quoting_still_reads_quoted_commas_newlines_and_doubled_quotes(images):
    table = images / "t.csv"
    table.write_text('image,caption\n0.png,"multi\nline, with a comma"\n1.png,"said ""hi"""\n2.png,plain\n')
    api.shard(str(table), images / "out")
    assert captions_of(images / "out") == [["multi\nline, with a comma"], ['said "hi"'], ["plain"]]


def test_a_tsv_is_read_without_quoting(images):
    table = images / "t.tsv"
    table.write_text(
        'caption\timage\n"the hobbit" poster\t0.png\n"unbalanced quote\t1.png\nrow three\t2.png\n'
    )
    manifest = api.shard(str(table), images / "out")
    assert manifest["n"] == 3  # before: 1 sample, the rows after the quote gone uncounted
    assert captions_of(images / "out") == [['"the hobbit" poster'], ['"unbalanced quote'], ["row three"]]


def test_a_caption_file_with_a_byte_order_mark_loses_the_mark(images):
    folder = images / "folder"
    folder.mkdir()
    (images / "0.png").rename(folder / "a.png")
    (folder / "a.txt").write_bytes("\ufeffa red square\r\nsecond".encode())
    api.shard(f"folder:{folder}", images / "out")
    assert captions_of(images / "out") == [["a red square", "second"]]


@pytest.mark.parametrize(
    "uri", ["synthetic://shapes?n=abc", "synthetic://shapes?n=-1", "synthetic://shapes?x=1"]
)
def test_bad_synthetic_numbers_are_data_errors_the_cli_shows_in_one_line(tmp_path, uri):
    with pytest.raises(DataError):  # a ValueError traceback before (still a ValueError too)
        api.shard(uri, tmp_path / "out")


def test_an_idx_file_of_empty_images_is_refused(tmp_path):
    import numpy as np

    from clipkit.data.shard import open_source

    header = bytes([0, 0, 8, 3]) + b"".join(n.to_bytes(4, "big") for n in (2, 0, 8))
    (tmp_path / "e-images-idx3-ubyte").write_bytes(header)
    labels = np.zeros(2, dtype=np.uint8)
    (tmp_path / "e-labels-idx1-ubyte").write_bytes(
        bytes([0, 0, 8, 1]) + (2).to_bytes(4, "big") + labels.tobytes()
    )
    with pytest.raises(DataError, match=r"e-images-idx3-ubyte: its images are 0×8 pixels"):
        open_source(f"idx:{tmp_path / 'e-images-idx3-ubyte'}")


def test_a_shard_sample_without_an_image_names_its_members():
    from clipkit.data.shard import decode_record

    with pytest.raises(DataError, match=r"sample 'a' has no image member \(png/jpg.*its members: json, txt"):
        decode_record({"__key__": "a", "json": b"{}", "txt": b"x"}, "wds")  # "()": a StopIteration's text


def test_img2dataset_samples_whose_data_is_gone_are_counted(tmp_path):
    # A shard with only NNNNN_stats.json left: its downloaded samples vanished uncounted.
    from test_dataset_sources import img2dataset_output, jpeg

    from clipkit.data.shard import open_source

    root = tmp_path / "out"
    img2dataset_output(
        root, "files", [[{"url": "u", "caption": "ok", "licence": "l", "image": jpeg((1, 1, 1))}]]
    )
    (root / "00001_stats.json").write_text(
        json.dumps({"count": 3, "successes": 3, "status_dict": {"success": 3}})
    )
    source = open_source(f"img2dataset:{root}")
    assert [s.key for s in source] == ["000000000"]
    assert source.skipped == {"missing_image": 3}
