"""The loader reads each byte once (issue 44): an epoch's stream is cut into lanes, each read by one
loader worker; the batches depend on the lanes, never on the number of workers; the bytes read
and fetched per source are counted (against the shard sizes, the HTTP server's own log, and the
bytes a ``pipe:`` command wrote); one lane is the order from before lanes, so older checkpoints
resume exactly."""

from __future__ import annotations

import collections
import itertools
import json
import math
import random
import shutil
import tarfile
from pathlib import Path

import pytest
import torch
from stream_servers import http_server, moto_available, s3_server

from clipkit.app import api
from clipkit.contract.manager import make_plugin_manager
from clipkit.contract.registry import Registry
from clipkit.data import tar_index
from clipkit.data.epoch_plan import EpochPlan, Segment, cut_segments, lane_quotas, lane_range, read_segments
from clipkit.data.loader import BatchStream, metric_label
from clipkit.data.shard import verify_shards
from clipkit.data.tar_index import index_path, parse_index
from clipkit.data.transforms import ImageTransform

SOURCE = "synthetic://shapes?n=128&split=train&image_size=24"
ALL = "shard-{000000..000007}.tar"  # 8 shards of 16: an epoch of 128 samples, 16 batches of 8
TRANSFORM = ImageTransform(image_size=16, mean=(0.5,) * 3, std=(0.25,) * 3, crop_scale=(0.5, 1.0))


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("split") / "shapes"
    api.shard(SOURCE, directory, samples_per_shard=16, registry=Registry(make_plugin_manager(autoload=False)))
    return directory


@pytest.fixture(scope="module")
def server(shards):
    with http_server(shards.parent) as running:
        yield running


def stream(shards, **options) -> BatchStream:
    settings = dict(batch_size=8, transform=TRANSFORM, tokenizer=None, seed=5, shuffle_buffer=20)
    settings.update(options)
    return BatchStream(shards, **settings)


def take(batches, count: int) -> list[dict]:
    iterator = iter(batches)
    return [next(iterator) for _ in range(count)]


def same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x["image"], y["image"]) and torch.equal(x["index"], y["index"])
        for x, y in zip(a, b, strict=True)
    )


def shard_bytes(shards: Path) -> int:
    return sum(path.stat().st_size for path in shards.glob("*.tar"))


def test_lanes_cut_the_rank_range_into_round_robin_quotas():
    segments = EpochPlan.build([("a", 10), ("b", 10), ("c", 7)], seed=0, epoch=0, rank=0, world_size=1,
                               batch_size=4).segments  # fmt: skip
    batches, total = 6, 27  # 27 samples give 6 batches of 4; 3 are left over
    for lanes in (1, 2, 3, 4, 7):
        quotas = lane_quotas(batches, lanes)
        # batch j is lane (j mod lanes)'s: lane l gets the j = l, l + lanes, ... below 6
        assert quotas == [sum(1 for j in range(batches) if j % lanes == lane) for lane in range(lanes)]
        covered = []
        for lane in range(lanes):
            start, stop = lane_range(lane, lanes, batches, 4, total)
            assert stop - start == quotas[lane] * 4 + (3 if lane == lanes - 1 else 0)
            for segment in cut_segments(segments, start, stop):
                covered += [(segment.url, row) for row in range(segment.start, segment.stop)]
        every = [(s.url, row) for s in segments for row in range(s.start, s.stop)]
        assert covered == every  # each sample in exactly one lane, in stream order
    assert cut_segments(segments, 0, total) == segments  # one lane: the rank's own segments


def old_order(
    shards: Path, epoch: int, seed: int = 5, batch_size: int = 8, buffer: int = 20
) -> list[list[int]]:
    """The batches (global indices) of the loader before lanes, restated from its docs: the
    rank's segments read as one stream, shuffled with a buffer seeded by (seed, epoch, rank, 0)."""
    import webdataset as wds

    from clipkit.data.loader import training_split
    from clipkit.data.shard import decode_record

    plan = EpochPlan.build(training_split(shards).counts, seed=seed, epoch=epoch, rank=0, world_size=1,
                           batch_size=batch_size)  # fmt: skip
    rng = random.Random(f"samples:{seed}:{epoch}:0:0")
    records = wds.shuffle(buffer, initial=buffer, rng=rng)(read_segments(plan.segments))
    return [
        [decode_record(r, "x").meta["index"] for r in itertools.islice(records, batch_size)]
        for _ in range(plan.batches)
    ]


def test_one_lane_is_the_order_from_before_lanes_and_an_old_position_resumes_it(shards):
    expected = old_order(shards, epoch=1)
    got = stream(shards, num_workers=2, lanes=1).loader(1, 0)
    assert [b["index"].tolist() for b in got] == expected
    # A checkpoint written before lanes existed has no "lanes" in its position: one lane, exactly.
    resumed = stream(shards, num_workers=2)
    assert resumed.lanes == 2
    resumed.restore({"epoch": 1, "batch_in_epoch": 5, "samples_seen": {}, "shards_skipped": {}})
    assert resumed.lanes == 1
    assert [b["index"].tolist() for b in take(resumed, 11)] == expected[5:]


@pytest.mark.parametrize("lanes", [2, 3, 4])
def test_batches_depend_on_the_lanes_never_on_the_workers(shards, lanes):
    reference = list(stream(shards, num_workers=0, lanes=lanes).loader(0, 0))
    assert len(reference) == 16
    seen = sorted(i for b in reference for i in b["index"].tolist())
    assert seen == list(range(128))  # every index exactly once in the epoch
    for workers in (1, 2, lanes):
        assert same(list(stream(shards, num_workers=workers, lanes=lanes).loader(0, 0)), reference)
    assert not same(reference, list(stream(shards, lanes=1).loader(0, 0)))  # lanes shape the order


@pytest.mark.parametrize("workers", [0, 1, 2, 4])
def test_each_byte_is_read_once_per_epoch_whatever_the_workers(shards, workers):
    batches = stream(shards, num_workers=workers)  # lanes: one per worker (the default)
    take(batches, 16)  # one epoch
    (read,) = batches.bytes_read.values()
    (fetched,) = batches.bytes_fetched.values()
    assert read == fetched == shard_bytes(shards)
    metrics = batches.metrics()
    assert metrics[f"data/bytes_read/{metric_label(0, str(shards))}"] == read


def test_workers_that_do_not_divide_the_lanes_share_them_and_the_counters_say_so(shards, capsys):
    # 2 workers over 1 lane (the loader before lanes): each reads everything, decodes half.
    shared = stream(shards, num_workers=2, lanes=1)
    take(shared, 16)
    assert sum(shared.bytes_read.values()) == 2 * shard_bytes(shards)
    assert "each byte is read 2 times" in capsys.readouterr().err
    # 2 workers over 3 lanes: gcd 1, so both read all three lanes.
    three = stream(shards, num_workers=2, lanes=3)
    take(three, 16)
    assert sum(three.bytes_read.values()) >= 2 * shard_bytes(shards) * 0.99
    assert math.gcd(2, 3) == 1


def test_http_fetches_each_shard_once_per_epoch_by_the_servers_log(shards, server):
    url = f"{server.url}/shapes/{ALL}"
    local = list(stream(shards, num_workers=0, lanes=2).loader(0, 0))
    server.requests.clear()
    batches = stream(url, num_workers=2)  # two workers, two lanes
    assert same(take(batches, 16), local)
    fetched = [path for path in server.requests if path.endswith(".tar")]
    assert sorted(fetched) == sorted(f"/shapes/shard-{n:06d}.tar" for n in range(8))
    assert sum(batches.bytes_fetched.values()) == sum(batches.bytes_read.values()) == shard_bytes(shards)


def test_pipe_commands_write_each_shard_once_per_epoch(shards, tmp_path):
    """Without counts (``pipe:``), lanes take every L-th shard; ``tee`` counts what the commands
    wrote, independently of the loader's counters. For tee's count the epoch is read to its end:
    a consumer that stops at the last batch stops the workers, and with them a command that may
    not yet have written its last bytes to the log (they were already on the pipe). ``tee -p``:
    the reader stops at the tar's end-of-archive blocks and closes the pipe; plain tee then died of
    the broken pipe before writing its last chunk to the log (4096 bytes short, under load)."""
    log = tmp_path / "tee.bin"
    spec = f"pipe:cat {shards}/{ALL} | tee -p -a {log}"
    one = stream(spec, num_samples=128, num_workers=0, lanes=2, shuffle_buffer=0)
    expected = list(one.loader(0, 0))
    assert len(expected) == 16
    two = stream(spec, num_samples=128, num_workers=2, shuffle_buffer=0)
    assert same(take(two, 16), expected)
    assert sum(two.bytes_fetched.values()) == shard_bytes(shards)  # the loader's counters
    log.unlink()
    whole_epoch = list(stream(spec, num_samples=128, num_workers=2, shuffle_buffer=0).loader(0, 0))
    assert same(whole_epoch, expected)
    assert log.stat().st_size == shard_bytes(shards)  # what the commands wrote


def test_a_mixture_reads_the_same_bytes_with_one_or_several_workers(shards, server):
    mixture = [
        {"shards": f"{server.url}/shapes/{ALL}", "weight": 2},
        {"shards": f"pipe:cat {shards}/shard-{{000000..000003}}.tar", "weight": 1, "num_samples": 64},
    ]
    one = stream(None, mixture=mixture, num_samples=128, num_workers=0, lanes=2)
    two = stream(None, mixture=mixture, num_samples=128, num_workers=2)
    assert same(take(two, 16), take(one, 16))
    assert two.bytes_fetched == one.bytes_fetched and len(two.bytes_fetched) == 2
    assert two.samples_seen == one.samples_seen
    old = stream(None, mixture=mixture, num_samples=128, num_workers=2, lanes=1)
    take(old, 16)  # both workers read the whole mixture
    assert sum(old.bytes_read.values()) > 1.5 * sum(two.bytes_read.values())


@pytest.mark.parametrize("lanes", [1, 3])
def test_resume_mid_epoch_is_exact_with_another_worker_count(shards, lanes):
    full = take(stream(shards, num_workers=0, lanes=lanes), 21)  # into the second epoch
    first = stream(shards, num_workers=3, lanes=lanes)
    head = take(first, 7)
    for workers in (0, 2):
        resumed = stream(shards, num_workers=workers)
        resumed.restore(first.position())
        assert resumed.lanes == lanes
        assert same(head + take(resumed, 14), full), workers


def test_ranks_with_lanes_see_every_index_once(shards):
    seen = []
    for rank in range(2):
        batches = stream(shards, num_workers=2, rank=rank, world_size=2).loader(0, 0)
        seen += [i for b in batches for i in b["index"].tolist()]
    assert sorted(seen) == list(range(128))


@pytest.mark.skipif(not moto_available(), reason="moto[server], boto3 or s3fs not installed (the dev extra)")
def test_s3_fetches_each_shard_once_per_epoch(shards):
    """2 lanes cut between shards, 3 inside them (entered and left by the shards' indexes)."""
    files = {f"shapes/{path.name}": path for path in shards.iterdir() if path.suffix in (".tar", ".idx")}
    files["shapes/manifest.json"] = shards / "manifest.json"
    size = shard_bytes(shards)
    with s3_server("clipkit-split", files):
        for lanes in (2, 3):
            local = list(stream(shards, num_workers=0, lanes=lanes).loader(0, 0))
            tar_index.forget()
            batches = stream(f"s3://clipkit-split/shapes/{ALL}", num_workers=lanes)
            assert same(take(batches, 16), local)
            cut = cut_shards(batches, lanes)
            indexes = sum(index_path(shards / name).stat().st_size for name in cut)
            # What the store was asked for: each byte once (a whole shard is under a block; a window
            # is fetched as asked); a cut shard's index by each of the two workers whose lanes meet there.
            assert sum(batches.bytes_read.values()) == size
            assert sum(batches.bytes_fetched.values()) == size + 2 * indexes, lanes
            assert bool(cut) == (lanes == 3)


def test_a_missing_shard_is_counted_once_and_its_lane_still_fills_its_batches(shards, server):
    import shutil

    gappy = shards.parent / "gappy"
    if not gappy.exists():
        shutil.copytree(shards, gappy)
        (gappy / "shard-000003.tar").unlink()  # listed in the manifest, gone from the server
    url = f"{server.url}/gappy/{ALL}"
    from clipkit.data.epoch_plan import ReadPolicy
    from clipkit.data.remote import Patience

    policy = ReadPolicy(Patience(timeout=1.0, retries=0, backoff=0.01))
    # 8 lanes of one shard each: the lane of the missing shard reads the others' again.
    for lanes, workers in ((2, 0), (2, 2), (8, 0), (8, 2)):
        batches = stream(url, num_workers=workers, lanes=lanes, policy=policy)
        got = take(batches, 16)
        assert all(len(b["index"]) == 8 for b in got), (lanes, workers)
        assert batches.shards_skipped["http_404"] >= 1


def cut_shards(batches: BatchStream, lanes: int) -> list[Path]:
    """The shards the epoch-0 lanes of a one-process run cut (a lane starts inside them)."""
    plan = EpochPlan.build(batches.shards, seed=5, epoch=0, rank=0, world_size=1, batch_size=8)
    segments = [s for lane in range(lanes) for s in plan.lane_segments(lane, lanes, 8) if s.start > 0]
    return sorted({Path(segment.url.rpartition("/")[2]) for segment in segments})


def test_every_shard_has_an_index_of_where_its_records_start(shards):
    """``shard-N.tar.idx``: each record's key and the offset of its first header, and the tar's size."""
    for tar in sorted(shards.glob("*.tar")):
        index = parse_index(index_path(tar).read_bytes())
        with tarfile.open(tar) as archive:
            firsts = {}
            for member in archive.getmembers():
                firsts.setdefault(member.name.split(".", 1)[0], member.offset)
        assert index is not None and index.size == tar.stat().st_size
        assert list(index.keys) == list(firsts) and list(index.offsets) == list(firsts.values())
    assert verify_shards(shards)["problems"] == []


def test_lanes_cutting_shards_read_and_fetch_each_byte_once_locally_and_over_http(shards, server):
    """3 lanes of 6, 5 and 5 batches: cuts fall inside shards. With the shards' indexes each lane
    reads only its records' bytes — a local file seeks, HTTP asks for a Range — so the epoch reads
    the data exactly once; what is fetched besides is the indexes of the shards cut (once per
    process: a loaded index is kept)."""
    tar_index.forget()
    local = stream(shards, num_workers=0, lanes=3)
    local_epoch = take(local, 16)
    server.ranges.clear()
    http = stream(f"{server.url}/shapes/{ALL}", num_workers=0, lanes=3)
    assert same(local_epoch, take(http, 16))
    size = shard_bytes(shards)
    cut = cut_shards(local, 3)
    assert cut
    indexes = sum(index_path(shards / name).stat().st_size for name in cut)
    for batches in (local, http):
        assert sum(batches.bytes_read.values()) == size
        assert sum(batches.bytes_fetched.values()) == size + indexes
    # What the server was asked for: each cut shard in parts that tile it, every other one whole.
    asked = collections.defaultdict(list)
    for path, header in server.ranges:
        if path.endswith(".tar"):
            length = (shards / Path(path).name).stat().st_size
            first, _, last = (header or "bytes=0-")[len("bytes=") :].partition("-")
            asked[Path(path).name].append((int(first), int(last) + 1 if last else length))
    assert len(asked) == 8
    for name, parts in asked.items():
        length = (shards / name).stat().st_size
        tiles = sorted(parts)
        assert tiles[0][0] == 0 and tiles[-1][1] == length, name
        assert all(a[1] == b[0] for a, b in itertools.pairwise(tiles)), name
        assert (len(parts) > 1) == (Path(name) in cut), name


def test_without_indexes_a_local_lane_reads_headers_and_a_streamed_one_the_records_before(shards, server):
    """Shards another tool wrote have no index: a local lane starting inside one reads the headers
    of the members before it; over HTTP (a stream) it reads those members. The batches are the same."""
    plain = shards.parent / "no-index"
    if not plain.exists():
        shutil.copytree(shards, plain, ignore=shutil.ignore_patterns("*.idx"))
    local = stream(plain, num_workers=0, lanes=3)
    http = stream(f"{server.url}/no-index/{ALL}", num_workers=0, lanes=3)
    indexed = take(stream(shards, num_workers=0, lanes=3), 16)
    assert same(take(local, 16), indexed) and same(take(http, 16), indexed)
    size = shard_bytes(plain)
    local_read, http_read = sum(local.bytes_read.values()), sum(http.bytes_read.values())
    assert size < local_read < http_read
    # Over the data, a local lane reads: the header blocks of the members up to its first, one byte
    # per member as tarfile checks the end, and the lane before the cut may read into the next
    # 10 KiB tar record.
    allowed = 0
    plan = EpochPlan.build(local.shards, seed=5, epoch=0, rank=0, world_size=1, batch_size=8)
    for name in cut_shards(local, 3):
        starts = [s.start for lane in range(3) for s in plan.lane_segments(lane, 3, 8)
                  if s.start > 0 and s.url.endswith(str(name))]  # fmt: skip
        with tarfile.open(plain / name) as tar:
            members = tar.getmembers()
        for start in starts:
            allowed += (
                sum(m.offset_data - m.offset + 1 for m in members[: 3 * start + 1]) + tarfile.RECORDSIZE
            )
    assert local_read - size <= allowed


def test_clipkit_shard_index_writes_the_indexes_another_tool_did_not(shards, server):
    """``clipkit shard DIR --index`` gives shards without indexes the very indexes clipkit writes;
    with them, lanes cutting those shards over HTTP read the data 1.00×."""
    from typer.testing import CliRunner

    from clipkit.app.cli import make_app

    plain = shards.parent / "indexed-later"
    shutil.copytree(shards, plain, ignore=shutil.ignore_patterns("*.idx"))
    result = CliRunner().invoke(make_app(), ["shard", str(plain), "--index"])
    assert result.exit_code == 0, result.output
    assert "wrote 8 index(es)" in result.output
    for tar in sorted(shards.glob("*.tar")):
        assert index_path(plain / tar.name).read_bytes() == index_path(tar).read_bytes()
    http = stream(f"{server.url}/indexed-later/{ALL}", num_workers=0, lanes=3)
    take(http, 16)
    assert sum(http.bytes_read.values()) == shard_bytes(shards)
    empty = shards.parent / "no-tars"
    empty.mkdir()
    refused = CliRunner().invoke(make_app(), ["shard", str(empty), "--index"])
    assert refused.exit_code != 0 and "no .tar files to index" in refused.output


@pytest.mark.parametrize("cut", ["inside a member", "at a header", "before the end blocks"])
def test_index_refuses_a_tar_cut_short_naming_it(shards, tmp_path, cut):
    """A tar cut short is not indexed (tarfile alone would end it silently where a header should
    be): ``--index`` stops with the file's name, keeping the indexes written before it."""
    from clipkit.errors import DataError

    for tar in sorted(shards.glob("*.tar"))[:2]:
        shutil.copy(tar, tmp_path / tar.name)
    second = tmp_path / "shard-000001.tar"
    index = parse_index(index_path(shards / second.name).read_bytes())
    data = second.read_bytes()
    members_end = -(-len(data.rstrip(b"\0")) // 512) * 512  # the last member's padded end
    ends = {"inside a member": index.offsets[3] + 700, "at a header": index.offsets[3],
            "before the end blocks": members_end}  # fmt: skip
    end = ends[cut]
    second.write_bytes(data[:end])
    with pytest.raises(DataError, match="shard-000001.tar: not a readable tar"):
        tar_index.index_directory(tmp_path)
    assert index_path(tmp_path / "shard-000000.tar").is_file()
    assert not index_path(second).exists()


def test_index_goes_on_past_unreadable_tars_and_names_each(shards, tmp_path):
    """``--index`` stopped at the first unreadable tar, leaving the readable ones after it without
    an index: now every readable tar is indexed, each unreadable one is named (as ``--verify``
    names each problem) and the command fails saying how many were not indexed."""
    import gzip

    from typer.testing import CliRunner

    from clipkit.app.cli import make_app

    first, second = sorted(shards.glob("*.tar"))[:2]
    shutil.copy(first, tmp_path / "a.tar")
    (tmp_path / "b.tar").write_bytes(first.read_bytes()[:700])  # cut inside its first member
    (tmp_path / "c.tar").write_bytes(gzip.compress(second.read_bytes()))  # a .tar.gz named .tar
    shutil.copy(second, tmp_path / "d.tar")
    result = CliRunner().invoke(make_app(), ["shard", str(tmp_path), "--index"])
    assert result.exit_code == 2, result.output
    assert index_path(tmp_path / "a.tar").is_file() and index_path(tmp_path / "d.tar").is_file()
    assert index_path(tmp_path / "d.tar").read_bytes() == index_path(second).read_bytes()
    assert not index_path(tmp_path / "b.tar").exists() and not index_path(tmp_path / "c.tar").exists()
    assert f"{tmp_path / 'b.tar'}: not a readable tar" in result.output
    assert f"{tmp_path / 'c.tar'} is a gzip-compressed tar" in result.output
    assert "2 of 4 tar(s) not indexed" in result.output and "the other 2 are" in result.output


def test_the_index_of_a_foreign_tar_groups_records_as_the_loader_does(tmp_path):
    """A tar another tool wrote (directories in member names, a directory member, dots in folder
    names): its index enters each record exactly where the loader's own grouping starts it."""
    import io as stdio

    path = tmp_path / "foreign.tar"
    with tarfile.open(path, "w") as tar:
        folder = tarfile.TarInfo("v1.2")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        for n in range(6):
            for field, body in (("jpg", b"x" * (100 + n)), ("txt", f"caption {n}".encode())):
                info = tarfile.TarInfo(f"v1.2/sample{n}.{field}")
                info.size = len(body)
                tar.addfile(info, stdio.BytesIO(body))
    tar_index.index_directory(tmp_path)
    whole = [r["__key__"] for r in read_segments([Segment(str(path), 0, None)])]
    assert whole == [f"v1.2/sample{n}" for n in range(6)]
    for start, stop in ((2, 5), (1, 6), (0, 3)):
        got = [r["__key__"] for r in read_segments([Segment(str(path), start, stop, count=6)])]
        assert got == whole[start:stop], (start, stop)


def stale_copy(shards: Path, name: str, change) -> Path:
    """A copy of the shard set whose ``name``'s index ``change(index dict)`` altered."""
    target = shards.parent / f"stale-{change.__name__}"
    if not target.exists():
        shutil.copytree(shards, target)
        index = json.loads(index_path(target / name).read_text())
        change(index)
        index_path(target / name).write_text(json.dumps(index))
    return target


def shifted(index: dict) -> None:
    index["offsets"] = [0] + [offset + 512 * 3 for offset in index["offsets"][1:-1]] + index["offsets"][-1:]


def resized(index: dict) -> None:
    index["size"] += 10240


@pytest.mark.parametrize("change", [shifted, resized])
def test_a_stale_index_is_not_trusted_and_the_tar_is_read_from_its_start(shards, server, change):
    """An index that does not match its tar (records at other offsets, another size): the lane
    reads the tar from its start instead — the same batches, locally and over HTTP."""
    reference = take(stream(shards, num_workers=0, lanes=3), 16)
    for name in cut_shards(stream(shards, num_workers=0, lanes=3), 3):
        stale = stale_copy(shards, name.name, change)
        local = stream(stale, num_workers=0, lanes=3)
        http = stream(f"{server.url}/{stale.name}/{ALL}", num_workers=0, lanes=3)
        assert same(take(local, 16), reference) and same(take(http, 16), reference), name
        assert sum(http.bytes_read.values()) > shard_bytes(shards)  # the stale one read from its start
        # `clipkit shard --verify` names it.
        assert verify_shards(stale)["problems"] == [
            f"{name}.idx: does not match {name} (the loader reads that tar from its start)"
        ]
        break


def test_a_server_that_ignores_range_is_read_from_the_start(shards, server):
    """Python's own file server answers a Range request with the whole file: each lane then reads
    the shard from its start, as without an index."""
    reference = take(stream(shards, num_workers=0, lanes=3), 16)
    ignoring = stream(f"{server.url}/norange/shapes/{ALL}", num_workers=0, lanes=3)
    assert same(take(ignoring, 16), reference)
    assert sum(ignoring.bytes_read.values()) > shard_bytes(shards)


def test_a_segment_inside_a_shard_gives_its_records_from_a_file_http_or_a_pipe(shards, server):
    """Records [5, 12) of a shard of 16: entered by the index (a file, HTTP) or read and dropped
    (a ``pipe:`` command, which has no file to index) — the same records, whatever the source."""
    name = "shard-000002.tar"
    urls = [str(shards / name), f"{server.url}/shapes/{name}", f"pipe:cat {shards / name}"]
    keys = [[r["__key__"] for r in read_segments([Segment(url, 5, 12, count=16)])] for url in urls]
    assert keys[0] == keys[1] == keys[2] == [f"{n:09d}" for n in range(37, 44)]
