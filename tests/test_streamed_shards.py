"""Shards read where they live: brace lists, loopback HTTP (flaky, stalling, cut, truncated),
``pipe:``, moto's S3 server; weighted mixtures; exact resume; a wrong path never trains."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import warm_launch
from stream_servers import copy_truncated, http_server, moto_available, s3_server

from clipkit.app import api
from clipkit.contract.manager import make_plugin_manager
from clipkit.contract.registry import Registry
from clipkit.data.loader import BatchStream, ReadPolicy
from clipkit.data.remote import Patience, redact
from clipkit.data.shard_sets import is_streamed, parse_mixture, resolve
from clipkit.data.transforms import ImageTransform
from clipkit.errors import ClipkitError, DataError

SOURCE = "synthetic://shapes?n=96&split=train&image_size=32"
BRACES = "shard-{000000..000005}.tar"
QUICK = Patience(timeout=1.0, retries=1, backoff=0.01)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("data") / "shapes"
    api.shard(SOURCE, directory, samples_per_shard=16, registry=Registry(make_plugin_manager(autoload=False)))
    return directory


@pytest.fixture(scope="module")
def server(shards):
    with http_server(shards.parent) as running:
        yield running


def stream(shards, **options) -> BatchStream:
    settings = dict(
        batch_size=8,
        transform=ImageTransform(image_size=16, mean=(0.5,) * 3, std=(0.25,) * 3, crop_scale=(0.5, 1.0)),
        tokenizer=None,
        seed=3,
        shuffle_buffer=20,
    )
    settings.update(options)
    return BatchStream(shards, **settings)


def take(batches: BatchStream, count: int) -> list[dict]:
    iterator = iter(batches)
    return [next(iterator) for _ in range(count)]


def same(a: list[dict], b: list[dict]) -> bool:
    return all(
        torch.equal(x["image"], y["image"]) and torch.equal(x["index"], y["index"])
        for x, y in zip(a, b, strict=True)
    )


def test_brace_lists_expand_several_groups_and_name_a_missing_file(shards, tmp_path):
    assert len(resolve(str(shards / BRACES)).urls) == 6
    two_groups = resolve(f"{shards.parent}/{{shapes,shapes}}/shard-00000{{0..2}}.tar")
    assert len(two_groups.urls) == 6 and two_groups.counts == (16,) * 6  # counts from manifest.json
    with pytest.raises(DataError, match=r"shard-000006\.tar does not exist \(and 3 more\)"):
        resolve(str(shards / "shard-{000004..000009}.tar"))


@pytest.mark.parametrize(
    "arguments, says",
    [
        (["data.shards=/path/that/does/not/exist"], "no such file or directory"),
        (["data.shards=/data/shard-{000000..000002}.tar"], "shard-000000.tar does not exist"),
        (["data.shards=http://127.0.0.1:9/shard-{000000..000002}.tar"], "cannot look for its manifest.json"),
        (["--data", "/path/that/does/not/exist"], "no such file or directory"),
        (["--data", "/data/shard-{000000..000002}.tar"], "shard-000000.tar does not exist"),
        (["--data", "http://127.0.0.1:9/shard-{000000..000002}.tar"], "cannot look for its manifest.json"),
    ],
)
def test_a_wrong_data_path_is_an_error_and_nothing_is_written(tmp_path, monkeypatch, arguments, says):
    from typer.testing import CliRunner

    from clipkit.app.cli import make_app

    monkeypatch.chdir(tmp_path)
    app = make_app(make_plugin_manager(autoload=False))
    command = ["train", "clip@tiny", *arguments, "train.steps=1", "data.retries=0", "data.timeout=2"]
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 2, (result.output, result.exception)
    assert says in result.output and "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == []  # no synthetic shards, no run directory


def test_an_empty_or_shardless_folder_is_refused(tmp_path):
    with pytest.raises(DataError, match="empty"):
        resolve(str(tmp_path))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DataError, match="holds no shards"):
        resolve(str(tmp_path))


def test_own_data_refuses_a_missing_path_and_streams_urls(tmp_path):
    from clipkit.app.own_data import own_data_overrides

    with pytest.raises(ClipkitError, match="no such file or directory"):
        own_data_overrides(str(tmp_path / "missing.jsonl"))
    overrides, notes = own_data_overrides(
        "http://host/shard-{0..3}.tar", eval_data=["http://host/val-{0..1}.tar"]
    )
    assert 'data.shards="http://host/shard-{0..3}.tar"' in overrides and "data.holdout=0.0" in overrides
    assert "streaming" in notes[0]


def test_the_quickstart_source_is_not_applied_to_another_data_shards():
    registry = Registry(make_plugin_manager(autoload=False))
    assert api.resolve("clip@tiny", [], registry)["data"]["source"].startswith("synthetic://")
    assert api.resolve("clip@tiny", ["data.shards=/elsewhere"], registry)["data"]["source"] == ""
    kept = api.resolve(
        "clip@tiny", ["data.shards=/elsewhere", "data.source=synthetic://shapes?n=8"], registry
    )
    assert kept["data"]["source"] == "synthetic://shapes?n=8"
    from clipkit.train.build import check_data_location

    both = ["data.shards=/x/shard-{0..1}.tar", "data.source=synthetic://shapes"]
    pattern = api.resolve("clip@tiny", both, registry)
    with pytest.raises(DataError, match="does not exist"):  # a pattern is never a place to write to
        check_data_location(pattern, registry)


def test_http_stream_gives_the_local_directorys_batches(shards, server):
    local = take(stream(str(shards)), 6)
    assert same(take(stream(f"{server.url}/shapes/{BRACES}"), 6), local)
    flaky = take(stream(f"{server.url}/flaky/shapes/{BRACES}", policy=ReadPolicy(QUICK)), 6)
    assert same(flaky, local)  # each shard answered 500 once, then was read in full
    assert any(path.startswith("/flaky/") for path in server.failed_once)
    cut = stream(f"{server.url}/cut/shapes/{BRACES}", policy=ReadPolicy(QUICK))
    assert same(take(cut, 6), local) and not cut.shards_skipped  # continued with Range requests


def test_pipe_cat_reads_shards_without_counts(shards):
    spec = f"pipe:cat {shards}/{BRACES}"
    with pytest.raises(DataError, match="set data.num_samples"):
        stream(spec)
    batches = take(stream(spec, num_samples=96), 12)  # one epoch of 96 // 8 batches
    indices = torch.cat([b["index"] for b in batches]).tolist()
    # The samples' json indices; passes follow each other through the shuffle buffer (20), so only
    # the samples still in it when the epoch ends may be replaced by the next pass's.
    assert set(indices) <= set(range(96)) and len(set(indices)) >= 96 - 20
    assert is_streamed(spec) and not is_streamed("synthetic://shapes") and not is_streamed("webdataset:x.tar")


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_pipe_curl_gives_pipe_cats_batches(shards, server):
    spec = f"pipe:curl -s -f {server.url}/shapes/shard-{{000000..000005}}.tar"
    cat = take(stream(f"pipe:cat {shards}/{BRACES}", num_samples=96), 4)
    assert same(take(stream(spec, num_samples=96), 4), cat)


def test_a_truncated_or_stalled_shard_is_skipped_and_counted_or_raises(shards, tmp_path, server):
    broken = tmp_path / "broken"
    shutil.copytree(shards, broken)
    copy_truncated(shards / "shard-000002.tar", broken / "shard-000002.tar")
    skipping = stream(str(broken / BRACES), policy=ReadPolicy(QUICK))
    batches = take(skipping, 24)  # two epochs and more: every epoch keeps its full batch count
    assert all(len(b["index"]) == 8 for b in batches)
    assert skipping.shards_skipped["corrupt_tar"] >= 1 and "data/skipped/corrupt_tar" in skipping.metrics()
    with pytest.raises(DataError, match=r"shard-000002\.tar.*data.on_error: raise"):
        take(stream(str(broken / BRACES), policy=ReadPolicy(QUICK, "raise")), 24)
    stalled = f"{server.url}/stall/shapes/shard-{{000000..000001}}.tar"
    policy = ReadPolicy(Patience(timeout=0.3, retries=0, backoff=0.01), "raise")
    with pytest.raises(DataError, match="timeout|timed out"):
        take(stream(stalled, num_samples=32, policy=policy, shuffle_buffer=0), 1)
    with pytest.raises(DataError, match="no output for 0.3 s"):  # a stalled pipe: command is killed
        take(stream("pipe:sleep 30", num_samples=32, policy=policy, shuffle_buffer=0), 1)


def test_resume_mid_epoch_on_a_stream_and_a_mixture_sees_the_same_samples(shards, server):
    url = f"{server.url}/shapes/{BRACES}"
    mixture = [
        {"shards": url, "weight": 3},
        {"shards": f"pipe:cat {shards}/{BRACES}", "weight": 1, "num_samples": 96},
    ]
    for options in ({}, {"resampled": True}, {"mixture": mixture}, {"mixture": mixture, "resampled": True}):
        full = take(stream(url, **options), 17)  # into the third epoch (12 batches per epoch... or 24)
        first = stream(url, **options)
        head = take(first, 9)
        resumed = stream(url, **options)
        resumed.restore(first.position())
        assert same(head + take(resumed, 8), full), options


def test_a_mixture_draws_by_weight_from_the_seed_and_counts_per_source(shards, server):
    mixture = f"3*{server.url}/shapes/{BRACES} :: 1*{shards}/shard-{{000000..000002}}.tar"
    assert [e.weight for e in parse_mixture(mixture)] == [3.0, 1.0]
    mixed = stream(None, mixture=mixture, num_samples=96)
    batches = take(mixed, 12)
    counts = list(mixed.samples_seen.values())
    assert sum(counts) == 96 and counts[0] > counts[1] > 0  # 3:1 in expectation, drawn from the seed
    assert same(batches, take(stream(None, mixture=mixture, num_samples=96), 12))
    # The second source's indices follow the first's 96.
    assert max(torch.cat([b["index"] for b in batches]).tolist()) >= 96
    with pytest.raises(DataError, match=r"data.mixture\[1\].weight"):
        parse_mixture([{"shards": "a.tar"}, {"shards": "b.tar", "weight": -1}])


def test_a_missing_shard_on_the_server_is_skipped_and_counted(shards, server):
    gappy = shards.parent / "gappy"
    if not gappy.exists():
        shutil.copytree(shards, gappy)
        (gappy / "shard-000003.tar").unlink()  # listed in the manifest, gone from the server
    batches = stream(f"{server.url}/gappy/{BRACES}", policy=ReadPolicy(QUICK))
    assert all(len(b["index"]) == 8 for b in take(batches, 12))
    assert batches.shards_skipped["http_404"] >= 1


@pytest.mark.skipif(not moto_available(), reason="s3fs not installed (the s3 extra)")
def test_an_unreachable_s3_endpoint_is_a_clear_error(monkeypatch):
    from stream_servers import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret")
    with pytest.raises(DataError, match="cannot look for its manifest.json") as raised:
        resolve("s3://bucket/shard-{0..1}.tar", Patience(timeout=1.0, retries=0, backoff=0.01))
    assert "testing-secret" not in str(raised.value)


def test_credentials_never_enter_a_recipe_or_a_message():
    with pytest.raises(ClipkitError, match="credentials"):
        resolve("https://user:secret@example.com/shard-{0..1}.tar")
    with pytest.raises(ClipkitError, match="'X-Amz-Signature' looks like a credential") as raised:
        resolve("https://example.com/shard-{0..1}.tar?X-Amz-Signature=abc123")
    assert "abc123" not in str(raised.value)
    assert "sig" not in redact("https://h/s.tar?X-Amz-Signature=sig&a=1")


def test_a_missing_fsspec_package_names_the_extra():
    pytest.importorskip("fsspec")
    try:
        import gcsfs  # noqa: F401

        pytest.skip("gcsfs is installed")
    except ImportError:
        pass
    with pytest.raises(ClipkitError, match=r"gcsfs.*clipkit-contrastive\[gcs\]"):
        resolve("gs://bucket/shard-{0..1}.tar")


@pytest.mark.skipif(not moto_available(), reason="moto[server], boto3 or s3fs not installed (the dev extra)")
def test_s3_through_fsspec_on_motos_server_gives_the_local_batches(shards):
    files = {f"shapes/{path.name}": path for path in shards.iterdir()}
    with s3_server("clipkit-test", files):
        shard_set = resolve("s3://clipkit-test/shapes/shard-{000000..000005}.tar")
        assert shard_set.counts == (16,) * 6
        got = take(stream("s3://clipkit-test/shapes/shard-{000000..000005}.tar"), 6)
    assert same(got, take(stream(str(shards)), 6))


@pytest.mark.slow
def test_training_streamed_from_http_and_a_mixture_resumes_bit_identically(shards, server, tmp_path):
    from test_graceful_stop import SignalAt, assert_same_weights, newest, registry

    from clipkit.train.stop import TrainingStopped

    url = f"{server.url}/shapes/{BRACES}"
    mixture = json.dumps(
        [{"shards": url, "weight": 2}, {"shards": f"pipe:cat {shards}/{BRACES}", "num_samples": 96}]
    )
    base = ["train.steps=6", "train.log_every=1", "train.checkpoint_every=4", "train.export=false",
            "data.batch_size=16", "eval=[]"]  # fmt: skip
    for name, data in (("http", [f"data.shards={url}"]), ("mixture", [f"data.mixture={mixture}"])):
        full, stopped = tmp_path / f"{name}-full", tmp_path / f"{name}-stopped"
        api.train("quickstart@smoke", base + data, run_dir=full, registry=registry())
        with pytest.raises(TrainingStopped):
            api.train("quickstart@smoke", base + data, run_dir=stopped, registry=registry(SignalAt(3, 15)))
        api.train("quickstart@smoke", run_dir=stopped, resume=True, registry=registry())
        assert_same_weights(newest(stopped), newest(full))
        logged = json.loads((full / "metrics.jsonl").read_text().splitlines()[-1])
        assert any(key.startswith("data/samples/") for key in logged), logged


def test_evaluation_reads_a_streamed_set_in_place(shards, server):
    from clipkit.data.shard import ShardSource, open_source

    streamed = list(open_source(f"{server.url}/shapes/{BRACES}"))
    local = list(ShardSource(shards))
    assert [(s.key, s.image, s.captions) for s in streamed] == [(s.key, s.image, s.captions) for s in local]


def test_streamed_batches_do_not_depend_on_the_number_of_workers(shards, server):
    # They depend on the lanes (by default one per worker, saved with the position), not the workers.
    pipe = {"shards": f"pipe:cat {shards}/shard-{{000000..000002}}.tar", "num_samples": 48}
    mixture = [{"shards": f"{server.url}/shapes/{BRACES}", "weight": 2}, pipe]
    one = take(stream(None, mixture=mixture, num_samples=96, lanes=2), 6)
    assert same(take(stream(None, mixture=mixture, num_samples=96, num_workers=2), 6), one)
    assert same(take(stream(None, mixture=mixture, num_samples=96, num_workers=1, lanes=2), 6), one)


@pytest.fixture(scope="module")
def foreign(shards, tmp_path_factory) -> Path:
    """open_clip / img2dataset-style shards of the same images: png + txt, no json, no manifest."""
    import webdataset as wds

    from clipkit.data.shard import ShardSource

    out = tmp_path_factory.mktemp("foreign")
    samples = list(ShardSource(shards))
    for number in range(2):
        with wds.TarWriter(str(out / f"part-{number}.tar")) as writer:
            for sample in samples[number * 48 : (number + 1) * 48]:
                writer.write({"__key__": f"s{sample.key}", "png": sample.image, "txt": sample.captions[0]})
    return out


def test_foreign_shards_are_numbered_by_their_sizes_json_or_refused_where_a_loss_needs_indices(foreign):
    spec = f"{foreign}/part-{{0..1}}.tar"
    unnumbered = take(stream(spec, num_samples=96), 2)
    assert all((b["index"] == -1).all() for b in unnumbered)  # no counts, no json index: none
    with pytest.raises(DataError, match="has no global index"):
        take(stream(spec, num_samples=96, require_index=True), 1)
    (foreign / "sizes.json").write_text(json.dumps({"part-0.tar": 48, "part-1.tar": 48}))
    try:
        batches = take(stream(spec, require_index=True), 12)
    finally:
        (foreign / "sizes.json").unlink()
    assert sorted(torch.cat([b["index"] for b in batches]).tolist()) == list(range(96))


@pytest.mark.parametrize("counted", [True, False])
def test_processes_share_an_epoch_of_a_streamed_set_without_overlap(shards, server, counted):
    spec = f"{server.url}/shapes/{BRACES}" if counted else f"pipe:cat {shards}/{BRACES}"
    seen = []
    for rank in range(2):
        ranked = stream(spec, num_samples=0 if counted else 96, rank=rank, world_size=2, shuffle_buffer=0)
        seen += torch.cat([b["index"] for b in take(ranked, 6)]).tolist()  # 96 / 2 / 8 batches each
    assert sorted(seen) == list(range(96))


@pytest.mark.slow
@pytest.mark.parametrize("data", ["mixture", "local"])
def test_a_streamed_mixture_killed_with_sigkill_resumes_bit_identically(shards, server, tmp_path, data):
    """kill -9 of a `clipkit train` process streaming a mixture (HTTP + pipe:), or reading a local
    shard directory, once a checkpoint exists, then --resume: the same weights, optimiser state
    and data position as a run never killed (SIGTERM is covered above; here no handler runs)."""
    from test_graceful_stop import assert_same_weights, newest
    from test_runtime import newest_step

    mixture = json.dumps(
        [{"shards": f"{server.url}/shapes/{BRACES}", "weight": 2},
         {"shards": f"pipe:cat {shards}/{BRACES}", "num_samples": 96}]
    )  # fmt: skip
    source = f"data.mixture={mixture}" if data == "mixture" else f"data.shards={shards}"
    # Two loader workers: two lanes, each read by one worker (the bytes of the epoch read once).
    overrides = ["train.steps=20", "train.checkpoint_every=2", "train.export=false", "data.batch_size=16",
                 "eval=[]", source, "data.num_workers=2"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def command(run_dir: Path, *extra: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "clipkit",
            "train",
            "quickstart@smoke",
            *extra,
            "--run-dir",
            str(run_dir),
        ]

    full, killed = tmp_path / "full", tmp_path / "killed"
    warm_launch.subprocess_run(command(full, *overrides), env=env, check=True)
    process = warm_launch.popen(command(killed, *overrides), env=env)
    while newest_step(killed) < 4 and process.poll() is None:  # ends on its own at worst (no clock)
        time.sleep(0.01)
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the kill should land before the 20-step run ends"
    warm_launch.subprocess_run(command(killed, "--resume"), env=env, check=True)
    assert_same_weights(newest(killed), newest(full))


def test_a_pipe_command_may_finish_after_the_reader_closes_its_output(tmp_path):
    """The reader stops at a tar's end-of-archive blocks, maybe before the command exits: closing
    waits for it (``tee`` writing its last chunk to a cache file), instead of killing it mid-way."""
    from clipkit.data.remote import PipeReader

    done = tmp_path / "done"
    reader = PipeReader(f"printf abc; sleep 0.3; touch {done}", timeout=10)
    assert reader.read(3) == b"abc"
    reader.close()
    assert done.exists() and reader.process.returncode == 0


def test_a_pipe_command_ignoring_the_broken_pipe_is_killed_after_the_grace(tmp_path, monkeypatch):
    from clipkit.data import remote

    monkeypatch.setattr(remote, "PIPE_CLOSE_GRACE_S", 0.2)
    reader = remote.PipeReader(f"trap '' PIPE; printf abc; sleep 30; touch {tmp_path / 'never'}", timeout=10)
    assert reader.read(3) == b"abc"
    began = time.monotonic()
    reader.close()
    assert time.monotonic() - began < 5 and reader.process.returncode == -signal.SIGKILL
    assert not (tmp_path / "never").exists()
