"""Resumable `clipkit shard`: kill -9 mid-run then rerun, interrupted file sources, --verify, shard size."""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import warm_launch

from clipkit.app import api
from clipkit.data.shard import read_manifest, verify_shards
from clipkit.data.shard_writer import parse_size, write_shards
from clipkit.errors import DataError
from clipkit.plugins.sources.synthetic_shapes import SyntheticShapes

SYNTHETIC = "synthetic://shapes?n=600&seed=5"
PER_SHARD = 20


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The shard set of an uninterrupted run (in-process)."""
    out = tmp_path_factory.mktemp("reference") / "shards"
    return write_shards(SyntheticShapes(n=600, seed=5), out, source=SYNTHETIC, samples_per_shard=PER_SHARD)


def shard_command(out: Path) -> list[str]:
    return [sys.executable, "-m", "clipkit", "shard", SYNTHETIC, str(out), f"--samples-per-shard={PER_SHARD}"]


def finished_shards(out: Path) -> int:
    journal = out.with_name(out.name + ".partial") / "journal.json"
    try:
        return len(json.loads(journal.read_text())["shards"])
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


@pytest.mark.parametrize("kill_after", [1, 7])
def test_kill_9_mid_run_then_rerun_verifies_and_equals_an_uninterrupted_run(tmp_path, reference, kill_after):
    out = tmp_path / "shards"
    process = warm_launch.popen(shard_command(out))
    deadline = time.monotonic() + 300  # a safety net against a hang, not a measured duration
    while finished_shards(out) < kill_after and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert process.poll() is None, "the run finished before it could be killed"
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert not out.exists() and finished_shards(out) >= kill_after

    rerun = warm_launch.subprocess_run(shard_command(out))
    assert rerun.returncode == 0, rerun.stderr
    assert verify_shards(out)["problems"] == []
    manifest = read_manifest(out)
    assert manifest["n"] == 600
    assert [s["sha256"] for s in manifest["shards"]] == [s["sha256"] for s in reference["shards"]]
    assert not out.with_name("shards.partial").exists()


def png(size=(6, 5), colour=(200, 30, 30)) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def table(tmp_path) -> Path:
    """A JSONL table of 57 rows: every 5th row's image is missing (skipped and counted)."""
    (tmp_path / "images").mkdir()
    rows = []
    for row in range(57):
        name = f"images/{row:03d}.png"
        if row % 5 != 0:
            (tmp_path / name).write_bytes(png(colour=(row, 2 * row, 3 * row)))
        rows.append(json.dumps({"image": name, "caption": f"picture {row}", "row": row}))
    path = tmp_path / "captions.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


class Interrupted(Exception):
    pass


def interrupt_after(samples: int):
    seen = []

    def progress(count):
        seen.append(count)
        if sum(seen) >= samples:
            raise Interrupted

    return progress


@pytest.mark.parametrize("workers", ["1", "3"])
def test_interrupted_table_source_resumes_from_its_position(tmp_path, table, workers):
    reference = api.shard(str(table), tmp_path / "reference", samples_per_shard=7)
    out = tmp_path / "shards"
    options = {"workers": workers}
    with pytest.raises(Interrupted):
        api.shard(str(table), out, samples_per_shard=7, options=options, progress=interrupt_after(25))
    journal = json.loads((tmp_path / "shards.partial" / "journal.json").read_text())
    # 3 shards of 7 were finished: rows 0-26, i.e. 21 samples and 6 missing images (rows 0, 5, ..., 25).
    position = {"consumed": 27, "yielded": 21, "skipped": {"missing_image": 6}}
    state = journal["state"]["source_state"]
    assert {key: state[key] for key in position} == position
    assert state["images"]["modes"] == {"RGB": 21}  # image counts resume too
    # Resume with another thread count and download timeout: they change speed, not the shards.
    manifest = api.shard(str(table), out, samples_per_shard=7, options={"workers": "2", "timeout": "30"})
    assert verify_shards(out)["problems"] == []
    assert manifest["n"] == reference["n"] == 45
    assert manifest["info"]["skipped"] == reference["info"]["skipped"] == {"missing_image": 12}
    assert manifest["info"]["image_modes"] == reference["info"]["image_modes"] == {"RGB": 45}
    assert [s["sha256"] for s in manifest["shards"]] == [s["sha256"] for s in reference["shards"]]


def test_rerun_with_other_arguments_is_refused_naming_the_partial_directory(tmp_path, table):
    out = tmp_path / "shards"
    with pytest.raises(Interrupted):
        api.shard(str(table), out, samples_per_shard=7, progress=interrupt_after(10))
    with pytest.raises(DataError, match=r"shards\.partial holds an interrupted run with other arguments"):
        api.shard(str(table), out, samples_per_shard=8)


def test_shard_size_limit_closes_shards_by_bytes(tmp_path):
    source = SyntheticShapes(n=60, seed=1)
    manifest = write_shards(source, tmp_path / "out", source="s", max_shard_bytes="20kB")
    sizes = [(tmp_path / "out" / s["name"]).stat().st_size for s in manifest["shards"]]
    assert len(sizes) > 1 and manifest["n"] == 60
    # A shard closes once its members reach the limit, so only its last sample may cross it; the
    # file adds tar's end blocks (1 KiB) padded to its 10 KiB record size.
    largest_sample = max(len(sample.image) for sample in source) + 3 * 1024  # png + txt + json members
    assert all(size <= 20_000 + largest_sample + 1024 + 10240 for size in sizes)
    assert all(size >= 20_000 for size in sizes[:-1])


def test_parse_size():
    assert parse_size("500MB") == 500_000_000 and parse_size("1GiB") == 2**30 and parse_size("4096") == 4096
    assert parse_size("1.5kb") == 1500 and parse_size(None) is None
    with pytest.raises(Exception, match="500XB"):
        parse_size("500XB")


@pytest.fixture
def finished(tmp_path):
    out = tmp_path / "shards"
    write_shards(SyntheticShapes(n=30, seed=2), out, source="s", samples_per_shard=10)
    return out


def test_verify_passes_on_an_intact_set(finished):
    assert verify_shards(finished) == {"n": 30, "shards": 3, "problems": []}


def test_verify_finds_an_altered_shard(finished):
    path = finished / "shard-000001.tar"
    data = bytearray(path.read_bytes())
    data[700] ^= 0xFF
    path.write_bytes(bytes(data))
    problems = verify_shards(finished)["problems"]
    assert any("shard-000001.tar: sha256 differs" in p for p in problems)


def test_verify_finds_a_missing_shard_and_the_indices_it_held(finished):
    (finished / "shard-000002.tar").unlink()
    problems = verify_shards(finished)["problems"]
    assert "shard-000002.tar: missing" in problems
    assert any(p.startswith("10 global indices missing, e.g. [20, 21, 22, 23, 24]") for p in problems)


def test_verify_finds_a_duplicated_sample_and_an_unlisted_tar(finished):
    import shutil

    manifest = json.loads((finished / "manifest.json").read_text())
    shutil.copy(finished / "shard-000000.tar", finished / "shard-000002.tar")
    shutil.copy(finished / "shard-000000.tar", finished / "extra.tar")
    manifest["shards"][2]["sha256"] = json.loads(json.dumps(manifest["shards"][0]["sha256"]))
    (finished / "manifest.json").write_text(json.dumps(manifest))
    problems = verify_shards(finished)["problems"]
    assert "extra.tar: a tar file the manifest does not list" in problems
    assert any("global index 0 also in shard-000000.tar" in p for p in problems)
    assert any(p.startswith("10 global indices missing, e.g. [20") for p in problems)


def test_cli_verify_exit_codes(finished):
    command = [sys.executable, "-m", "clipkit", "shard", "--verify", str(finished)]
    ok = warm_launch.subprocess_run(command)
    assert ok.returncode == 0 and "30 samples in 3 shard(s) match the manifest" in ok.stdout
    (finished / "shard-000000.tar").write_bytes(b"not a tar")
    bad = warm_launch.subprocess_run(command)
    assert bad.returncode == 2 and "shard-000000.tar" in bad.stderr
