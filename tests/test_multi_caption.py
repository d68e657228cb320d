"""Samples with several captions: table columns (caption_0..k, aliases), JSON lists in `txt`, the
error for a table without a caption column, and the caption training draws per visit."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from clipkit.app.cli import make_app
from clipkit.contract.types import Sample
from clipkit.data.captions import captions_from_text, draw_caption, record_captions
from clipkit.data.loader import BatchStream, ImageTransform
from clipkit.data.shard import ShardSource, decode_record, open_source
from clipkit.data.shard_writer import write_shards
from clipkit.errors import DataError


def png(value: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), (value, 0, 0)).save(buffer, format="PNG")
    return buffer.getvalue()


def images(directory: Path, n: int) -> list[str]:
    names = []
    for i in range(n):
        (directory / f"{i}.png").write_bytes(png(i))
        names.append(f"{i}.png")
    return names


# --- tables ---------------------------------------------------------------------------------


def test_numbered_caption_columns_in_csv_tsv_jsonl_and_parquet(tmp_path):
    """caption_0 .. caption_10 are all captions, in numeric order (caption_10 last), blank cells
    dropped (a row may have fewer), and none of them is meta-data."""
    first, second = images(tmp_path, 2)
    columns = ["image", "caption_10", "caption_0", "caption_2", "caption_1", "label"]
    rows = [
        [first, "ten", "zero", "two", "one", "3"],
        [second, "", "only", "", "", "4"],
    ]
    expected = [("zero", "one", "two", "ten"), ("only",)]
    (tmp_path / "t.csv").write_text("\n".join(",".join(row) for row in [columns, *rows]) + "\n")
    (tmp_path / "t.tsv").write_text("\n".join("\t".join(row) for row in [columns, *rows]) + "\n")
    objects = [{**dict(zip(columns, row, strict=True)), "label": int(row[-1])} for row in rows]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(row) + "\n" for row in objects))
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    table = {c: [row[i] or None for row in rows] for i, c in enumerate(columns)}
    pq.write_table(pa.table({**table, "label": [3, 4]}), tmp_path / "t.parquet")
    for name in ("t.csv", "t.tsv", "t.jsonl", "t.parquet"):
        samples = list(open_source(str(tmp_path / name)))
        assert [s.captions for s in samples] == expected, name
        assert [s.meta for s in samples] == [{"label": 3}, {"label": 4}], name


def test_caption_aliases_when_no_caption_column(tmp_path):
    (image,) = images(tmp_path, 1)
    (tmp_path / "text.jsonl").write_text(json.dumps({"image": image, "text": "a red square"}) + "\n")
    (tmp_path / "laion.csv").write_text(f"image,TEXT,similarity\n{image},a red square,0.3\n")
    for name in ("text.jsonl", "laion.csv"):
        (sample,) = open_source(str(tmp_path / name))
        assert sample.captions == ("a red square",), name
    # A `caption` column wins; `text` then stays meta-data, as before.
    (tmp_path / "both.jsonl").write_text(json.dumps({"image": image, "caption": "c", "text": "t"}) + "\n")
    (sample,) = open_source(str(tmp_path / "both.jsonl"))
    assert sample.captions == ("c",) and sample.meta == {"text": "t"}


@pytest.mark.parametrize("name", ["t.jsonl", "t.csv"])
def test_a_table_without_a_caption_column_names_the_columns(tmp_path, name):
    """Not "no samples": the error names the columns found, those expected and the remedy; exit 2."""
    (image,) = images(tmp_path, 1)
    if name.endswith(".jsonl"):
        (tmp_path / name).write_text(json.dumps({"image": image, "description": "a red square"}) + "\n")
    else:
        (tmp_path / name).write_text(f"image,description\n{image},a red square\n")
    with pytest.raises(DataError) as error:
        open_source(str(tmp_path / name))
    message = str(error.value)
    assert name in message and "'image', 'description'" in message
    assert "caption, captions, caption_0 .. caption_k" in message and "text" in message
    assert "caption=COL" in message
    result = CliRunner().invoke(make_app(), ["shard", str(tmp_path / name), str(tmp_path / "out")])
    assert result.exit_code == 2 and "'description'" in result.output and not (tmp_path / "out").exists()
    # Naming the column is the remedy the message gives.
    (sample,) = open_source(f"{tmp_path / name}?caption=description")
    assert sample.captions == ("a red square",)


def test_a_table_whose_rows_are_all_skipped_says_why(tmp_path):
    (image,) = images(tmp_path, 1)
    (tmp_path / "blank.jsonl").write_text(json.dumps({"image": image, "caption": "  "}) + "\n")
    result = CliRunner().invoke(make_app(), ["shard", str(tmp_path / "blank.jsonl"), str(tmp_path / "out")])
    assert result.exit_code == 2 and "yielded no samples" in result.output
    assert "1 empty_caption" in result.output and "strict=true" in result.output


# --- shards and WebDataset tars --------------------------------------------------------------


def test_captions_from_text():
    assert captions_from_text('["a dog", "a brown dog"]') == ["a dog", "a brown dog"]
    assert captions_from_text("a dog") == ["a dog"]
    assert captions_from_text("[citation needed] a dog") == ["[citation needed] a dog"]
    assert captions_from_text("[1, 2]") == ["[1, 2]"]  # no captions in it: the text itself
    assert captions_from_text("[]") == ["[]"]
    assert captions_from_text("[not json]") == ["[not json]"]


def test_webdataset_txt_holding_a_json_list_gives_several_captions(tmp_path):
    path = tmp_path / "shard-000000.tar"
    members = [
        ("a.png", png(1)),
        ("a.txt", b'["a dog on grass", "a brown dog"]'),
        ("b.png", png(2)),
        ("b.txt", b"[draft] one caption"),
    ]
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    samples = list(open_source(f"webdataset:{path}"))
    assert [s.captions for s in samples] == [("a dog on grass", "a brown dog"), ("[draft] one caption",)]
    # Re-sharded, all captions are kept (json "captions"), the first also in txt.
    write_shards(samples, tmp_path / "shards", source="test")
    assert [s.captions for s in ShardSource(tmp_path / "shards")] == [s.captions for s in samples]


def test_a_shard_record_without_json_captions_reads_txt():
    record = {"__key__": "000000007", "png": png(1), "json": json.dumps({"index": 7}).encode()}
    assert decode_record(record, "x").captions == ()
    record["txt"] = b'["one", "two"]'
    assert decode_record(record, "x").captions == ("one", "two")
    record["json"] = json.dumps({"index": 7, "captions": ["kept"]}).encode()
    assert decode_record(record, "x").captions == ("kept",)  # the json's list wins
    assert record_captions({}, b"  ") == ()
    with pytest.raises(DataError, match="000000007"):
        decode_record({**record, "json": b"{}", "txt": b"\xff"}, "x")


# --- the caption training draws ---------------------------------------------------------------


def test_draw_caption_is_a_seeded_uniform_draw():
    captions = ("a", "b", "c", "d")
    draws = [draw_caption(captions, seed=0, epoch=e, index=5) for e in range(400)]
    assert draws == [draw_caption(captions, seed=0, epoch=e, index=5) for e in range(400)]
    counts = {c: draws.count(c) for c in captions}
    assert min(counts.values()) > 60  # uniform: 100 each expected
    by_index = [draw_caption(captions, seed=0, epoch=0, index=i) for i in range(40)]
    by_seed = [draw_caption(captions, seed=s, epoch=0, index=5) for s in range(40)]
    assert len(set(by_index)) == len(set(by_seed)) == 4
    assert draw_caption(("only",), seed=1, epoch=2, index=3) == "only"


class CaptionIds:
    """A tokenizer that maps each caption to its id, so a batch says which caption was drawn."""

    def __init__(self, captions: list[str]) -> None:
        self.ids = {caption: i for i, caption in enumerate(captions)}

    def __call__(self, texts: list[str]) -> torch.Tensor:
        return torch.tensor([[self.ids[text]] for text in texts])


N, CAPTIONS = 24, 4


@pytest.fixture(scope="module")
def multi_caption_shards(tmp_path_factory):
    directory = tmp_path_factory.mktemp("multi") / "shards"
    samples = [
        Sample(str(i), png(i), "png", tuple(f"sample {i} caption {c}" for c in range(CAPTIONS)), {})
        for i in range(N)
    ]
    write_shards(samples, directory, source="test", samples_per_shard=10)
    return directory, [caption for s in samples for caption in s.captions]


def drawn(directory, captions, epoch, **options) -> dict[int, str]:
    """{global index: the caption it was trained on} over one epoch of every rank."""
    world_size = options.pop("world_size", 1)
    seen = {}
    for rank in range(world_size):
        stream = BatchStream(
            directory,
            batch_size=4,
            transform=ImageTransform(image_size=8, mean=(0.5,) * 3, std=(0.5,) * 3, **options.pop("aug", {})),
            tokenizer=CaptionIds(captions),
            seed=7,
            rank=rank,
            world_size=world_size,
            **options,
        )
        for batch in stream.loader(epoch, 0):
            for index, text in zip(batch["index"].tolist(), batch["text"][:, 0].tolist(), strict=True):
                seen[index] = captions[text]
    return seen


def test_the_trained_caption_is_a_function_of_seed_epoch_and_index_only(multi_caption_shards):
    """Whatever the workers, ranks, shuffle buffer, views or augmentation, sample i in epoch e is
    trained on draw_caption(seed, e, i); over epochs each sample sees several of its captions."""
    directory, captions = multi_caption_shards
    for epoch in (0, 1):
        reference = drawn(directory, captions, epoch)
        assert sorted(reference) == list(range(N))
        for index, caption in reference.items():
            own = captions[index * CAPTIONS : (index + 1) * CAPTIONS]
            assert caption == draw_caption(own, seed=7, epoch=epoch, index=index)
        variants = [
            {"num_workers": 2},
            {"world_size": 2, "shuffle_buffer": 5},
            {"views": 2, "aug": {"crop_scale": (0.5, 1.0), "hflip": True, "color_jitter": 0.4}},
        ]
        for options in variants:
            assert drawn(directory, captions, epoch, **options) == reference, options
    per_sample = {i: {draw_caption("abcd", seed=7, epoch=e, index=i) for e in range(6)} for i in range(N)}
    assert all(len(seen) > 1 for seen in per_sample.values())


def test_coco_mini_keeps_five_captions_and_training_draws_among_them(shared_data, tmp_path):
    """Real multi-caption data (51 COCO photos x 5 captions): sharded with every caption, and each
    epoch trains every photo on one of its own 5, drawn as draw_caption says."""
    table = shared_data / "coco-mini-cc-by" / "captions.jsonl"
    rows = [json.loads(line) for line in table.read_text(encoding="utf-8").splitlines() if line.strip()]
    write_shards(open_source(str(table)), tmp_path / "coco", source=str(table), samples_per_shard=20)
    stored = [s.captions for s in ShardSource(tmp_path / "coco")]
    assert stored == [tuple(c.strip() for c in row["captions"]) for row in rows]
    assert {len(captions) for captions in stored} == {5}
    everything = sorted({caption for captions in stored for caption in captions})
    for epoch in (0, 3):
        seen = drawn(tmp_path / "coco", everything, epoch, shuffle_buffer=8)
        assert len(seen) == 48  # 51 samples in batches of 4
        for index, caption in seen.items():
            assert caption == draw_caption(stored[index], seed=7, epoch=epoch, index=index)


def test_a_jsonl_first_row_may_lack_a_named_meta_key(tmp_path):
    """JSONL rows need not share every key: only the image and caption columns are required of
    the first row (a named meta key absent there is simply absent from that sample)."""
    first, second = images(tmp_path, 2)
    rows = [{"image": first, "caption": "a"}, {"image": second, "caption": "b", "label": 2}]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert [s.meta for s in open_source(f"{tmp_path / 't.jsonl'}?meta=label")] == [{}, {"label": 2}]
