"""Inputs that used to defeat `clipkit shard`: FIFOs, devices, directories and symlink loops named
like images, oversized files, malformed URLs; the completion window; concurrent writers.

Every test that touches a FIFO or a device has a timeout: before the fix it hung (or read
``/dev/zero`` until memory ran out).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path

import pytest
import warm_launch

from clipkit.app import api
from clipkit.data.shard import MANIFEST, read_manifest, verify_shards
from clipkit.data.shard_writer import JOURNAL, partial_directory, write_shards
from clipkit.errors import DataError
from clipkit.plugins.sources.source_base import BadRow, read_image
from clipkit.plugins.sources.synthetic_shapes import SyntheticShapes

pytestmark = pytest.mark.timeout(120)


def png(size: int = 4, noise: bool = False) -> bytes:
    from PIL import Image

    if noise:  # incompressible: a PNG of about 3·size² bytes
        image = Image.frombytes("RGB", (size, size), os.urandom(3 * size * size))
    else:
        image = Image.new("RGB", (size, size), (200, 30, 30))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def hazard_folder(root: Path) -> Path:
    """A caption folder with one good image and one of each hazard, each with a caption file."""
    root.mkdir()
    (root / "good.png").write_bytes(png())
    os.mkfifo(root / "fifo.png")
    (root / "folder.png").mkdir()
    os.symlink("loop.png", root / "loop.png")  # a link to itself: ELOOP
    os.symlink("/dev/zero", root / "zero.png")
    (root / "big.png").write_bytes(png(64, noise=True))
    for stem in ("good", "fifo", "folder", "loop", "zero", "big"):
        (root / f"{stem}.txt").write_text(f"a {stem} picture\n")
    return root


def skipped(manifest: dict) -> dict[str, int]:
    return manifest["info"]["skipped"]


def test_a_folder_of_hazards_is_sharded_with_every_skip_counted(tmp_path):
    folder = hazard_folder(tmp_path / "images")
    out = tmp_path / "shards"
    manifest = api.shard(f"folder:{folder}", out, options={"max_image_bytes": "4KiB"})
    assert manifest["n"] == 1
    assert skipped(manifest) == {"not_a_file": 3, "symlink_loop": 1, "too_large": 1}
    assert verify_shards(out)["problems"] == []


def test_a_caption_or_meta_file_that_is_a_fifo_does_not_hang(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    for stem in ("a", "b"):
        (folder / f"{stem}.png").write_bytes(png())
    (folder / "a.txt").write_text("a caption\n")
    os.mkfifo(folder / "b.txt")
    (folder / "c.png").write_bytes(png())
    (folder / "c.txt").write_text("c caption\n")
    os.mkfifo(folder / "c.json")
    manifest = api.shard(f"folder:{folder}", tmp_path / "shards")
    assert manifest["n"] == 1 and skipped(manifest) == {"not_a_file": 2}


def test_a_table_naming_devices_fifos_directories_loops_and_bad_urls(tmp_path):
    (tmp_path / "good.png").write_bytes(png())
    os.mkfifo(tmp_path / "fifo.png")
    (tmp_path / "folder.png").mkdir()
    os.symlink("a.png", tmp_path / "b.png")
    os.symlink("b.png", tmp_path / "a.png")  # a two-link loop
    images = ["good.png", "/dev/zero", "fifo.png", "folder.png", "a.png", "http://[::1",
              "http://user:secret@[::1/x.png", "good.png"]  # fmt: skip
    table = tmp_path / "table.jsonl"
    rows = [{"image": image, "caption": f"row {n}"} for n, image in enumerate(images)]
    table.write_text("".join(json.dumps(row) + "\n" for row in rows))
    manifest = api.shard(str(table), tmp_path / "shards")
    assert manifest["n"] == 2
    assert skipped(manifest) == {"bad_url": 2, "not_a_file": 3, "symlink_loop": 1}


def test_strict_names_the_malformed_url_without_its_password(tmp_path):
    (tmp_path / "good.png").write_bytes(png())
    table = tmp_path / "table.jsonl"
    rows = [{"image": "good.png", "caption": "ok"}, {"image": "http://user:secret@[::1/x", "caption": "x"}]
    table.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(DataError, match=r"line 2: bad_url") as raised:
        api.shard(str(table), tmp_path / "shards", options={"strict": "true"})
    assert "secret" not in str(raised.value) and "[::1/x" in str(raised.value)


def test_the_size_limit_reads_at_most_one_byte_more(tmp_path):
    data = png(16, noise=True)
    path = tmp_path / "image.png"
    path.write_bytes(data)
    assert read_image(path, len(data))[0] == data  # exactly at the limit: read
    with pytest.raises(BadRow) as raised:
        read_image(path, len(data) - 1)
    assert raised.value.reason == "too_large"


def test_dev_zero_is_refused_without_being_read():
    with pytest.raises(BadRow) as raised:
        read_image(Path("/dev/zero"))
    assert raised.value.reason == "not_a_file" and "character device" in raised.value.detail


@pytest.mark.parametrize("value", ["abc", "0", "-5MB"])
def test_a_bad_max_image_bytes_option_is_named(tmp_path, value):
    folder = hazard_folder(tmp_path / "images")
    with pytest.raises(DataError, match="max_image_bytes"):
        api.shard(f"folder:{folder}", tmp_path / "shards", options={"max_image_bytes": value})


# ----------------------------------------------------------------------------- completion window


class Counted(SyntheticShapes):
    """Synthetic shapes that count how many samples were read."""

    reads = 0

    def __iter__(self):
        for sample in super().__iter__():
            Counted.reads += 1
            yield sample


def test_a_run_killed_between_manifest_and_rename_is_finished_without_rereading(tmp_path, monkeypatch):
    import clipkit.data.shard_writer as writer

    out, source = tmp_path / "shards", "synthetic://shapes?n=30"

    def killed(finished, target):
        raise KeyboardInterrupt  # stands for kill -9 after the manifest was written

    monkeypatch.setattr(writer, "replace_directory", killed)
    with pytest.raises(KeyboardInterrupt):
        write_shards(SyntheticShapes(n=30), out, source=source, samples_per_shard=8)
    assert (partial_directory(out) / MANIFEST).is_file() and not out.exists()
    monkeypatch.undo()

    Counted.reads = 0
    manifest = write_shards(Counted(n=30), out, source=source, samples_per_shard=8)
    assert Counted.reads == 0  # finished from OUT.partial, not re-sharded
    assert manifest == read_manifest(out) and manifest["n"] == 30
    assert verify_shards(out)["problems"] == []
    assert not partial_directory(out).exists() and not (out / JOURNAL).exists()


def test_a_journal_left_in_a_finished_set_is_removed_by_the_next_writer(tmp_path):
    out, source = tmp_path / "shards", "synthetic://shapes?n=10"
    write_shards(SyntheticShapes(n=10), out, source=source)
    assert not (out / JOURNAL).exists()
    (out / JOURNAL).write_text("{}")  # killed after the rename, before the journal was removed
    assert verify_shards(out)["problems"] == []  # a finished set with a stray journal is still intact
    write_shards(SyntheticShapes(n=10), out, source=source)
    assert not (out / JOURNAL).exists()


# ----------------------------------------------------------------------------- concurrent writers

CONCURRENT = "synthetic://shapes?n=400&seed=3"


def start_together(argv: list[str], cwd: Path, *, script: Path | None = None) -> list:
    """Three ``python -m clipkit ARGV`` (or ``python SCRIPT ARGV``) processes at once, forked warm
    (tests/warm_launch.py: each a fresh process, minus the ~4 CPU-s of imports), to completion."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    processes = [warm_launch.WarmLaunch(argv, cwd=cwd, env=env, script=script) for _ in range(3)]
    results = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=300)
        results.append(subprocess.CompletedProcess(argv, process.returncode, stdout, stderr))
    return results


def assert_one_intact_set(out: Path, n: int) -> None:
    manifest = read_manifest(out)
    assert manifest["n"] == n and manifest["source"] == CONCURRENT
    assert verify_shards(out)["problems"] == []
    leftovers = sorted(p.name for p in out.parent.iterdir() if p.name not in (out.name, f"{out.name}.lock"))
    assert leftovers == []  # no .partial, no .old


@pytest.mark.slow
def test_three_shard_commands_started_together_all_succeed_with_one_set(tmp_path):
    out = tmp_path / "data" / "shards"
    results = start_together(["shard", CONCURRENT, str(out), "--samples-per-shard=50"], tmp_path)
    for result in results:
        assert result.returncode == 0, result.stderr
        assert "wrote 400 samples in 8 shard(s)" in result.stdout
    assert sum("waiting for it to finish" in result.stderr for result in results) >= 1
    assert_one_intact_set(out, 400)


@pytest.mark.slow
def test_training_runs_started_together_share_the_shards_of_their_source(tmp_path):
    """What `clipkit train` does first (ensure_shards), in three processes at once."""
    out = tmp_path / "data" / "shards"
    script = tmp_path / "ensure.py"
    script.write_text(
        "import sys\nfrom clipkit.data.shard_writer import ensure_shards\nensure_shards(*sys.argv[1:3])\n"
    )
    results = start_together([str(out), CONCURRENT], tmp_path, script=script)
    for result in results:
        assert result.returncode == 0, result.stderr
    assert_one_intact_set(out, 400)
