"""The hostile matrix, round three (issue 42): each case is the command a hostile user ran.

Groups: transport faults go through the retry/skip policy (loopback HTTP on 127.0.0.1, ``pipe:``);
loader worker errors reach the user as the in-process line; settings are finite and parseable at
``validate``; reports never share a name, keep the index whole and are filed only with the weights
they scored; data given is data used (class lists, skip counts, checks before training);
credentials stay on their host; every output path is checked before work; ``convert`` on damaged
files. A refusal is exit code 2, one line, no traceback, nothing lost.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
import torch
from stream_servers import http_server
from typer.testing import CliRunner

from clipkit.app import api
from clipkit.app.cli import make_app
from clipkit.artifacts.export import write_export
from clipkit.config.recipe import load_recipe, validate_or_raise
from clipkit.contract.manager import make_plugin_manager
from clipkit.contract.registry import Registry
from clipkit.data.epoch_plan import Faults, ReadPolicy, Segment, read_segments
from clipkit.data.loader import BatchStream
from clipkit.data.remote import Patience, ShardUnavailable
from clipkit.data.shard_sets import parse_mixture
from clipkit.data.tar_stream import tar_records
from clipkit.data.transforms import ImageTransform
from clipkit.errors import ClipkitError, DataError, redact_text
from clipkit.eval.report_index import (
    INDEX_NAME,
    next_report_path,
    read_index,
    record_report,
    report_slug,
)
from clipkit.model import build_model

runner = CliRunner()
SOURCE = "synthetic://shapes?n=48&split=train&image_size=32"
QUICK = Patience(timeout=1.0, retries=1, backoff=0.01)
TINY = "clip@tiny"


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("data") / "shapes"
    api.shard(SOURCE, directory, samples_per_shard=16, registry=Registry(make_plugin_manager(autoload=False)))
    return directory


@pytest.fixture(scope="module")
def server(shards):
    with http_server(shards.parent) as running:
        yield running


@pytest.fixture
def app():
    return make_app(make_plugin_manager(autoload=False))


def invoke(app, *args, **kwargs):
    return runner.invoke(app, [str(a) for a in args], **kwargs)


def assert_refused(result, *names: str) -> None:
    """Exit code 2, one error line holding every name, no traceback."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.output
    for name in names:
        assert name in result.output, result.output


def stream(shards, **options) -> BatchStream:
    settings = dict(
        batch_size=8,
        transform=ImageTransform(image_size=16, mean=(0.5,) * 3, std=(0.25,) * 3),
        tokenizer=None,
        seed=3,
        shuffle_buffer=0,
    )
    settings.update(options)
    return BatchStream(shards, **settings)


# ============================================================================ transport faults


def fault_of(url: str, patience: Patience = QUICK) -> ShardUnavailable:
    """The ShardUnavailable reading ``url`` to its end raises (any other exception fails the test)."""
    with pytest.raises(ShardUnavailable) as caught:
        for _ in tar_records(url, patience):
            pass
    return caught.value


def test_every_http_transport_fault_is_a_counted_shard_fault(server):
    """A chunked body cut mid-shard (IncompleteRead), a malformed status line (BadStatusLine), an
    unparseable URL (ValueError: Invalid IPv6 URL), a refused connection: each a ShardUnavailable."""
    base = f"{server.url}"
    assert fault_of(f"{base}/chunked-cut/shapes/shard-000000.tar").reason in ("broken_stream", "unreachable")
    assert fault_of(f"{base}/bad-status/shapes/shard-000000.tar").reason in ("broken_stream", "unreachable")
    assert fault_of("http://[::1/shard.tar").reason == "bad_url"
    from stream_servers import free_port

    assert fault_of(f"http://127.0.0.1:{free_port()}/x.tar").reason == "unreachable"


def test_a_tar_cut_at_or_inside_a_member_header_is_corrupt_not_shorter(shards, tmp_path):
    """tarfile ends an archive silently where a header is missing or partial: a shard cut there
    would read as a valid one with fewer samples. It is a corrupt_tar fault instead — local, as a
    segment entered mid-shard, and through a pipe — after the whole records before the cut; a tar
    whose end-of-archive blocks are cut after their first block still reads whole."""
    import tarfile

    tar = shards / "shard-000000.tar"
    data = tar.read_bytes()
    with tarfile.open(tar) as archive:
        members = list(archive)
    record_starts: dict[str, int] = {}  # key -> offset of the record's first member header
    for member in members:
        record_starts.setdefault(member.name.split(".")[0], member.offset)
    keys = list(record_starts)[:3]
    fourth = record_starts[list(record_starts)[3]]
    last = members[-1]
    members_end = last.offset_data + -(-last.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    cuts = {"at-a-header": fourth, "inside-a-header": fourth + 100, "before-the-end-blocks": members_end}
    for name, cut in cuts.items():
        broken = tmp_path / f"{name}.tar"
        broken.write_bytes(data[:cut])
        for url in (str(broken), f"pipe:cat {broken}"):
            fault = fault_of(url)
            assert fault.reason == "corrupt_tar" and "truncated" in str(fault), (name, url, fault)
        with pytest.raises(ShardUnavailable, match="truncated"):
            list(tar_records(str(broken), QUICK, skip=1))
    taken = []
    with pytest.raises(ShardUnavailable):
        for record in tar_records(str(tmp_path / "inside-a-header.tar"), QUICK):
            taken.append(record["__key__"])
    assert taken == keys  # the three whole records before the cut, then the fault
    kept = tmp_path / "end-block-cut.tar"
    kept.write_bytes(data[: members_end + tarfile.BLOCKSIZE + 100])
    assert sum(1 for _ in tar_records(str(kept), QUICK)) == 16


def test_a_pipe_exit_status_is_always_read(shards, tmp_path):
    """A command that writes a complete tar and exits 1 fails the shard; one that closes its
    output and lingers is killed after the timeout, as a fault (not TimeoutExpired)."""
    tar = shards / "shard-000000.tar"
    assert sum(1 for _ in tar_records(f"pipe:cat {tar}", QUICK)) == 16  # exit 0: read as before
    failed = fault_of(f"pipe:cat {tar}; exit 1")
    assert failed.reason == "pipe_failed" and "exit status 1" in str(failed)
    lingering = fault_of(f"pipe:cat {tar}; exec 1>&-; sleep 30", Patience(timeout=0.5, retries=0))
    assert lingering.reason == "timeout" and "did not exit" in str(lingering)


def test_a_failed_shard_is_fetched_and_reported_once_per_epoch(shards, server):
    """A stalled / missing shard is not re-fetched on every pass over the readable ones: one
    request and one report per epoch, however many passes fill the epoch's batches."""
    gappy = shards.parent / "gappy42"
    if not gappy.exists():
        shutil.copytree(shards, gappy)
        (gappy / "shard-000001.tar").unlink()
    url = f"{server.url}/gappy42/shard-{{000000..000002}}.tar"
    before = sum("shard-000001" in path for path in server.requests)
    batches = stream(url, policy=ReadPolicy(QUICK))
    iterator = iter(batches)
    for _ in range(6):  # one epoch: 48 samples / 8 (the two readable shards are read again)
        next(iterator)
    assert batches.epoch == 0 or batches.batch_in_epoch == 0
    assert sum("shard-000001" in path for path in server.requests) - before == 1
    assert batches.shards_skipped == {"http_404": 1}
    faults = Faults()
    segments = [Segment(f"{server.url}/gappy42/shard-000001.tar", 0, None)] * 3
    assert list(read_segments(segments, 0.0, ReadPolicy(QUICK), faults)) == []
    assert len(faults) == 1  # listed three times in the epoch, counted once


def test_loader_worker_errors_are_the_in_process_line(shards):
    """The same one line (the shard's sample named, the fault said) with 0 and 2 loader workers."""
    lines = []
    for workers in (0, 2):
        broken = stream(str(shards), num_workers=workers, meta_keys={"age": "no_such_column"})
        with pytest.raises(DataError) as caught:
            next(iter(broken))
        lines.append(str(caught.value))
    assert lines[0] == lines[1] and "\n" not in lines[1]
    assert "Caught" not in lines[1] and "Traceback" not in lines[1] and "no_such_column" in lines[1]


# ============================================================================ settings


@pytest.mark.parametrize(
    "override, key",
    [
        ("data.timeout=.inf", "data.timeout"),
        ("data.timeout=1e308", "data.timeout"),
        ("data.retries=100000000000000000000000", "data.retries"),
        ("optimizer.lr=.nan", "optimizer.lr"),
        ("data.mixture='inf*a.tar :: 1*b.tar'", "data.mixture[0].weight"),
        ("data.shards='http://[::1/shard-{0..1}.tar'", "data.shards"),
        ("data.mixture='1*http://host:port/a.tar :: 1*b.tar'", "data.mixture[0].shards"),
        ("data.mixture='2* :: 1*b.tar'", "data.mixture[0]: names no shards"),
        # round four: train refused it at start, after validate said ok
        ("train.micro_batch_size=7", "train.micro_batch_size: 7 does not divide data.batch_size"),
    ],
)
def test_validate_refuses_numbers_and_urls_training_would_crash_on(app, in_tmp, override, key):
    result = invoke(app, "validate", TINY, override)
    assert_refused(result, key)
    assert list(in_tmp.iterdir()) == []


def test_an_empty_mixture_source_is_named_as_the_mixture_entry(app, in_tmp, shards):
    (in_tmp / "empty").mkdir()
    result = invoke(app, "validate", TINY, f"data.mixture='1*{shards} :: 1*{in_tmp / 'empty'}'")
    assert_refused(result, "data.mixture[1].shards", "empty")
    assert "data.shards" not in result.output


def test_huge_mixture_weights_are_an_even_mixture_not_inf_over_inf():
    entries = parse_mixture("1e308*a.tar :: 1e308*b.tar")
    assert [entry.weight for entry in entries] == [1.0, 1.0]
    assert [entry.weight for entry in parse_mixture("3*a.tar :: 1*b.tar")] == [3.0, 1.0]  # as given


def test_train_refuses_infinite_epochs_before_anything(app, in_tmp):
    result = invoke(app, "train", TINY, "--data", "synthetic://shapes?n=64", "--epochs", "inf")
    assert_refused(result, "--epochs")
    assert list(in_tmp.iterdir()) == []


@pytest.mark.parametrize("override", ["model.image_size=1000000000", "model.embed_dim=100000000000"])
def test_sizes_no_memory_holds_are_one_line_naming_the_slot(app, in_tmp, override):
    result = invoke(app, "train", TINY, override, "train.steps=1", "data.num_workers=0", "--run-dir", "run")
    assert_refused(result, "cannot be built", override.partition("=")[0].split(".")[1])


# ============================================================================ reports


@pytest.fixture
def export(tmp_path, registry):
    overrides = ["model.tokenizer.name=clip_bpe", "model.tokenizer.context_length=16"]
    recipe = validate_or_raise(load_recipe(TINY, overrides, registry=registry), registry)
    torch.manual_seed(0)
    return write_export(build_model(recipe, registry), recipe, tmp_path / "export", registry)


EVAL_DATA = "synthetic://shapes?n=16&split=heldout&image_size=32"


def eval_args(export, *more):
    return ["eval", export, "--task", "retrieval", "--data", EVAL_DATA, "--no-plots", *more]


def own_reports(export: Path) -> list[Path]:
    return sorted(
        p for p in export.glob("eval-*.json")
        if "-clip_benchmark-" not in p.name and not p.name.startswith("eval-index")
    )  # fmt: skip


@pytest.mark.parametrize(
    "damage",
    [b"\xff\xfe not utf-8", b'{"reports": [1, "x", null]}', b'{"reports": {"a": 1}}', b"[1, 2"],
)
def test_a_damaged_index_is_set_aside_named_and_rebuilt(app, export, damage, caplog):
    first = invoke(app, *eval_args(export))
    assert first.exit_code == 0, first.output
    (export / INDEX_NAME).write_bytes(damage)
    second = invoke(app, *eval_args(export))
    assert second.exit_code == 0, second.output
    aside = list(export.glob("eval-index.damaged-*.json"))
    assert len(aside) == 1 and aside[0].read_bytes() == damage  # kept for inspection, named
    assert aside[0].name in caplog.text
    listed = [entry["report"] for entry in read_index(export)]
    assert sorted(listed) == [p.name for p in own_reports(export)] and len(listed) == 2  # nothing lost
    entry = read_index(export)[-1]
    metadata = json.loads((export / "clipkit.json").read_text())
    assert entry["weights_sha256"] == metadata["files"]["model.safetensors"]["sha256"]
    compared = invoke(app, "report", export, "--out", export.parent / "cmp")
    assert compared.exit_code == 0, compared.output


@pytest.mark.parametrize(
    "results",
    [[1, 2], [{"name": 3}], [{"name": "zero_shot", "top1": "high"}], [{"name": "zero_shot", "chance": []}]],
)
def test_report_on_a_results_file_with_non_row_entries_is_one_line(app, tmp_path, results):
    bad = tmp_path / "eval-bad.json"
    bad.write_text(json.dumps({"results": results}))
    assert_refused(invoke(app, "report", bad, "--out", tmp_path / "out"), str(bad))
    assert not (tmp_path / "out").exists()


def test_report_on_a_non_utf8_report_names_it(app, tmp_path):
    bad = tmp_path / "eval.json"
    bad.write_bytes(b'{"results": ["\xff"]}')
    assert_refused(invoke(app, "report", bad, "--out", tmp_path / "out"), str(bad), "UTF-8")


def claim_names(home: str, count: int, queue) -> None:
    queue.put([next_report_path(Path(home), [{"name": "retrieval"}], now=0.0).name for _ in range(count)])


def record_many(home: str, worker: int, count: int) -> None:
    for i in range(count):
        report = Path(home) / f"eval-w{worker}-{i}.json"
        report.write_text(json.dumps({"results": []}))
        record_report(Path(home), report, {"results": []})


def test_concurrent_evaluations_get_distinct_names_and_all_reach_the_index(tmp_path):
    """Eight processes claiming names in the same second, then eight recording reports at once."""
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    workers = [context.Process(target=claim_names, args=(str(tmp_path), 5, queue)) for _ in range(8)]
    for worker in workers:
        worker.start()
    names = [name for _ in workers for name in queue.get(timeout=60)]
    for worker in workers:
        worker.join(60)
    assert len(names) == 40 and len(set(names)) == 40
    home = tmp_path / "home"
    home.mkdir()
    workers = [context.Process(target=record_many, args=(str(home), w, 5)) for w in range(8)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
        assert worker.exitcode == 0
    assert len({entry["report"] for entry in read_index(home)}) == 40


def test_a_report_is_filed_only_with_the_weights_it_scored(export, registry, monkeypatch, tmp_path):
    """An eval racing a re-export (train --resume) is not listed in the new export's index with the
    old weights' numbers, and writes no report into it."""
    from clipkit.eval import evaluate as evaluate_module

    real = evaluate_module.evaluate_export
    recipe = json.loads((export / "clipkit.json").read_text())["recipe"]

    def racing(*args, **kwargs):
        report = real(*args, **kwargs)
        torch.manual_seed(1)  # another model replaces the export while this one is scored
        write_export(build_model(recipe, registry), recipe, export, registry)
        return report

    monkeypatch.setattr(evaluate_module, "evaluate_export", racing)
    output = next_report_path(export, [{"name": "retrieval"}])
    with pytest.raises(ClipkitError, match="replaced while it was evaluated"):
        api.evaluate(export, [{"name": "retrieval", "data": EVAL_DATA}], registry=registry, output=output,
                     plots=False)  # fmt: skip
    assert own_reports(export) == [] and read_index(export) == []


def test_a_report_an_earlier_index_write_missed_is_added_back(tmp_path, monkeypatch):
    """A full disk when the index was written leaves the report standing but unlisted; the next
    evaluation's index lists it again (nothing lost)."""
    import clipkit.eval.report_index as index_module
    from clipkit.artifacts.io import DiskFullError

    first = tmp_path / "eval-first.json"
    first.write_text(json.dumps({"results": [{"name": "retrieval", "mean_recall": 0.5}]}))

    def full(path, text):
        raise DiskFullError(f"{path}: no space left on the device")

    monkeypatch.setattr(index_module, "atomic_write_text", full)
    with pytest.raises(DiskFullError):
        record_report(tmp_path, first, {"results": []})
    monkeypatch.undo()
    second = tmp_path / "eval-second.json"
    second.write_text(json.dumps({"results": []}))
    record_report(tmp_path, second, {"results": []})
    assert [entry["report"] for entry in read_index(tmp_path)] == ["eval-first.json", "eval-second.json"]
    assert read_index(tmp_path)[0]["tasks"] == ["retrieval"]


def test_report_names_carry_the_task_data_and_label():
    one = report_slug([{"name": "zero_shot", "data": "/x/pets.jsonl", "label": "breed"}])
    two = report_slug([{"name": "zero_shot", "data": "/x/pets.jsonl", "label": "species"}])
    assert one != two and one.endswith("breed") and two.endswith("species")


def test_a_failed_eval_leaves_no_claimed_name(app, export):
    before = sorted(p.name for p in export.iterdir())
    result = invoke(app, "eval", export, "--task", "retrieval", "--data", "/no/such/data.jsonl")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert sorted(p.name for p in export.iterdir()) == before


# ============================================================================ data given is data used


def png_bytes(colour) -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def write_wds(root: Path, labels: list[int], classnames: list[str] | None) -> Path:
    test = root / "test"
    test.mkdir(parents=True)
    with tarfile.open(test / "0.tar", "w") as tar:
        for i, label in enumerate(labels):
            for name, data in (
                (f"s{i:04d}.png", png_bytes((40 * label, 0, 0))),
                (f"s{i:04d}.cls", str(label).encode()),
            ):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                import io

                tar.addfile(info, io.BytesIO(data))
    (test / "nshards.txt").write_text("1\n")
    if classnames is not None:
        (root / "classnames.txt").write_text("".join(f"{name}\n" for name in classnames))
    (root / "zeroshot_classification_templates.txt").write_text("a photo of a {c}.\n")
    return root


@pytest.mark.parametrize(
    "classnames, says",
    [(["red", "green"], "outside the 2 classes"), (None, "classnames.txt is missing")],
)
def test_a_clip_benchmark_set_whose_labels_the_class_list_does_not_cover_is_refused(
    app, export, tmp_path, classnames, says
):
    wds = write_wds(tmp_path / "wds_colours", [0, 1, 2, 3], classnames)
    result = invoke(app, "eval", export, "--task", "zero_shot", "--data", f"wds:{wds}", "--no-plots")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert says in result.output and "top1" not in result.output


def write_table_with_missing_images(directory: Path, n: int = 40, missing: int = 10) -> Path:
    from PIL import Image

    rows = []
    for i in range(n):
        if i >= missing:
            Image.new("RGB", (16, 16), ((i * 37) % 255, 80, 160)).save(directory / f"{i}.png")
        rows.append({"image": f"{i}.png", "caption": f"picture {i % 4}", "category": f"c{i % 4}"})
    table = directory / "table.jsonl"
    table.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return table


TRAIN_FAST = ["train.steps=1", "data.num_workers=0", "train.export=false", "--holdout", "0.25"]


def test_train_data_prints_the_skip_counts_shard_prints(app, in_tmp):
    table = write_table_with_missing_images(in_tmp)
    result = invoke(app, "train", "quickstart@smoke", "--data", table, *TRAIN_FAST, "--run-dir", "run")
    assert result.exit_code == 0, result.output
    shard = invoke(app, "shard", table, in_tmp / "shards")
    assert shard.exit_code == 0, shard.output
    (line,) = [line for line in shard.output.splitlines() if line.startswith("skipped")]
    assert line.startswith("skipped 10 bad row(s):")
    assert line in result.output


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--label", "no_such_column"], "'no_such_column' is not in the data"),
        (["--eval-data", "/no/such/eval.jsonl"], "/no/such/eval.jsonl"),
    ],
)
def test_checks_that_need_only_the_data_run_before_training(app, in_tmp, extra, says):
    table = write_table_with_missing_images(in_tmp, missing=0)
    result = invoke(
        app, "train", "quickstart@smoke", "--data", table, *TRAIN_FAST, *extra, "--run-dir", "run"
    )
    assert_refused(result, says)
    assert not (in_tmp / "run").exists()


# ============================================================================ credentials


def test_netrc_credentials_never_follow_a_redirect_to_another_host(shards, tmp_path, monkeypatch):
    with http_server(shards.parent) as first, http_server(shards.parent) as second:
        port = second.url.rsplit(":", 1)[1]
        first.redirect_to = f"http://localhost:{port}"  # another host name, same loopback server
        netrc = tmp_path / "netrc"
        netrc.write_text("machine 127.0.0.1 login alice password s3cret\n")
        netrc.chmod(0o600)
        monkeypatch.setenv("NETRC", str(netrc))
        records = list(tar_records(f"{first.url}/redirect/shapes/shard-000000.tar", QUICK))
        assert len(records) == 16
        assert [auth for _, auth in first.authorizations][-1] is not None  # its own host: sent
        assert second.authorizations and all(auth is None for _, auth in second.authorizations)


def test_query_values_are_redacted_in_every_message(app, shards, server, in_tmp):
    secret = "session=hunter2"
    redacted = redact_text(f"see pipe:curl -s 'http://u:p@h/x.tar?{secret}&a=b' now")
    assert "hunter2" not in redacted and "u:p@" not in redacted and "session=***" in redacted
    url = f"{server.url}/shapes/missing-{{0..1}}.tar?{secret}"
    result = invoke(app, "train", TINY, f"data.shards={url}", "data.on_error=raise", "data.num_samples=32",
                    "data.retries=0", "--run-dir", in_tmp / "run")  # fmt: skip
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "hunter2" not in result.output and "session=***" in result.output
    # a pipe: command naming a signed URL, failing: the command and its stderr are redacted
    command = f"pipe:cat /no/such.tar 'http://127.0.0.1:1/x.tar?{secret}'"
    settings = [f"data.shards={command}", "data.num_samples=64", "data.on_error=raise"]
    failing = invoke(app, "train", TINY, *settings, "--run-dir", in_tmp / "run2")
    assert failing.exit_code == 2 and "Traceback" not in failing.output and "exit status 1" in failing.output
    assert "hunter2" not in failing.output and "session=***" in failing.output


# ============================================================================ writers


def test_an_output_under_a_file_is_one_line_naming_it(app, in_tmp, export):
    blocker = in_tmp / "file.txt"
    blocker.write_text("mine\n")
    for args in (
        ["shard", "synthetic://shapes?n=8", blocker / "sub"],
        ["convert", export, blocker / "sub"],
        ["eval", *eval_args(export, "--output", blocker / "sub" / "r.json")[1:]],
        ["train", "quickstart@smoke", "train.steps=1", "--run-dir", blocker / "run"],
        ["export", in_tmp, blocker / "sub"],
        ["report", export, "--out", blocker / "sub"],
    ):
        assert_refused(invoke(app, *args), str(blocker))
    assert blocker.read_text() == "mine\n"
    assert_refused(invoke(app, *eval_args(export, "--output", in_tmp)), "is a directory")


@pytest.fixture
def read_only(tmp_path):
    """A read-only tmpfs (root only; skipped where it cannot be mounted)."""
    point = tmp_path / "ro"
    point.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(point)],
                          capture_output=True, text=True, check=False)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield point
    subprocess.run(["umount", str(point)], check=False)


def test_a_read_only_target_is_one_line_naming_it(app, read_only, export):
    for args in (
        ["shard", "synthetic://shapes?n=8", read_only / "shards"],
        ["convert", export, read_only / "converted"],
        ["eval", *eval_args(export, "--output", read_only / "r.json")[1:]],
        ["train", "quickstart@smoke", "train.steps=1", "--run-dir", read_only / "run"],
    ):
        assert_refused(invoke(app, *args), str(read_only), "Read-only file system")


# ============================================================================ convert on damaged files


def safetensors_with_header(header: dict | bytes, data: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b'{"model_cfg": {}}', id="json-renamed"),
        pytest.param((1 << 60).to_bytes(8, "little") + b"{}", id="absurd-header-length"),
        pytest.param(
            safetensors_with_header({"w": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
            id="unknown-dtype",
        ),  # fmt: skip
        pytest.param(
            safetensors_with_header(
                {"w": {"dtype": "F32", "shape": [1 << 40, 1 << 40], "data_offsets": [0, 8]}}, b"\0" * 8
            ),
            id="absurd-shape",
        ),  # fmt: skip
        pytest.param(
            safetensors_with_header(
                {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8
            ),
            id="truncated",
        ),  # fmt: skip
        pytest.param(
            safetensors_with_header({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
            id="foreign-tensors",
        ),  # fmt: skip
    ],
)
def test_convert_on_damaged_or_foreign_safetensors_is_one_line(app, tmp_path, content):
    source = tmp_path / "weights.safetensors"
    source.write_bytes(content)
    result = invoke(app, "convert", source, tmp_path / "out", "--no-quick-gelu")
    assert_refused(result, str(source))
    assert not (tmp_path / "out").exists()


def test_convert_on_a_truncated_open_clip_model_is_one_line(app, export, tmp_path):
    converted = tmp_path / "open_clip"
    assert invoke(app, "convert", export, converted, "--to", "open_clip").exit_code == 0
    weights = converted / "open_clip_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert_refused(invoke(app, "convert", converted, tmp_path / "back"), str(weights))
    (converted / "open_clip_config.json").write_bytes(b"\xff\xfe")
    assert_refused(invoke(app, "convert", converted, tmp_path / "back"), "open_clip_config.json")
    assert not (tmp_path / "back").exists()
