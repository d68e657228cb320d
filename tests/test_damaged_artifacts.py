"""Reading damaged or crafted artifacts: exports, checkpoints, shard manifests and recipes.

Every damage below gives exit code 2 with a message naming the file and no traceback; a
crafted pickle never runs; every flipped byte is detected by the recorded sha256.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import stat
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import warm_launch
from typer.testing import CliRunner

from clipkit.app.cli import make_app
from clipkit.artifacts.integrity import describe_files
from clipkit.contract.manager import make_plugin_manager

runner = CliRunner()
SMOKE = "quickstart@smoke"
STEP = "checkpoints/step-00000002"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 2-step quickstart@smoke run with two checkpoints and an export (made once, copied per test)."""
    root = tmp_path_factory.mktemp("trained")
    command = [sys.executable, "-m", "clipkit", "train", SMOKE, "train.steps=2", "train.checkpoint_every=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = warm_launch.subprocess_run([*command, "--run-dir", "run"], cwd=root, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return root


@pytest.fixture
def work(trained, tmp_path, monkeypatch) -> Path:
    """A private copy of the trained run (and its shards), as the working directory."""
    shutil.copytree(trained, tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def app():
    return make_app(make_plugin_manager(autoload=False))


def invoke(app, *args: str):
    return runner.invoke(app, [str(a) for a in args])


def assert_clean_failure(result, names: str) -> None:
    """Exit code 2 (a ClipkitError), the file named, no traceback."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert names in result.output, result.output
    assert "Traceback" not in result.output


# ----------------------------------------------------------------------------- damage helpers


def flip_byte(path: Path, position: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    position = len(data) // 2 if position is None else position
    data[position] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path, keep: float = 0.5) -> None:
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])


def rechecksum_export(export: Path) -> None:
    """Record the current weights' checksum, so only the damage under test can be detected."""
    metadata = json.loads((export / "clipkit.json").read_text())
    metadata["files"] = describe_files(export, ["model.safetensors"])
    (export / "clipkit.json").write_text(json.dumps(metadata))


def rechecksum_checkpoint(directory: Path) -> None:
    from clipkit.train.checkpoint import MANIFEST, write_manifest

    (directory / MANIFEST).unlink()
    write_manifest(directory)


def rewrite_weights(export: Path, change: Callable[[dict], None]) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(export / "model.safetensors")
    change(tensors)
    save_file(tensors, export / "model.safetensors", metadata={"format": "clipkit-export/1"})
    rechecksum_export(export)


def rewrite_state(checkpoint: Path, change: Callable[[dict], object]) -> None:
    state = torch.load(checkpoint / "state.pt", weights_only=True)
    state = change(state) or state
    torch.save(state, checkpoint / "state.pt")
    rechecksum_checkpoint(checkpoint)


def edit_json(path: Path, change: Callable[[dict], None]) -> None:
    value = json.loads(path.read_text())
    change(value)
    path.write_text(json.dumps(value))


class Marker:
    """A pickled object whose loading creates a marker file: proof that code ran."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


# ----------------------------------------------------------------------------- the matrix

EXPORT, CKPT = Path("run/export"), Path("run") / STEP
EVAL = ("eval", "run/export", "--no-plots", "--output", "report.json")
RESUME = ("train", SMOKE, "train.steps=3", "--resume", "--run-dir", "run")
EXPORT_CMD = ("export", "run", "out")
VERIFY = ("shard", "data/smoke-shapes", "--verify")


def shard_dir() -> Path:
    found = [p.parent for p in Path("data").glob("*/manifest.json")]
    assert len(found) == 1, found
    return found[0]


def damage_manifest(change: Callable[[Path], None]) -> Callable[[], None]:
    return lambda: change(shard_dir() / "manifest.json")


def write_recipe(text: bytes) -> Callable[[], None]:
    return lambda: Path("bad.yaml").write_bytes(text)


# (id, damage done in the working copy, command, text the message must contain)
DAMAGES: list[tuple[str, Callable[[], None], tuple, str]] = [
    # --- exports (clipkit eval)
    ("weights-missing", lambda: (EXPORT / "model.safetensors").unlink(), EVAL, "model.safetensors"),
    ("weights-truncated", lambda: truncate(EXPORT / "model.safetensors"), EVAL, "model.safetensors"),
    ("weights-flipped-byte", lambda: flip_byte(EXPORT / "model.safetensors"), EVAL, "model.safetensors"),
    (
        "weights-bad-header",
        lambda: (flip_byte(EXPORT / "model.safetensors", 3), rechecksum_export(EXPORT)),
        EVAL,
        "model.safetensors",
    ),
    (
        "weights-garbage",
        lambda: ((EXPORT / "model.safetensors").write_bytes(b"\0" * 64), rechecksum_export(EXPORT)),
        EVAL,
        "model.safetensors",
    ),
    (
        "weights-reshaped",
        lambda: rewrite_weights(
            EXPORT, lambda t: t.update({k: v.flatten() for k, v in t.items() if v.ndim > 1})
        ),
        EVAL,
        "model.safetensors",
    ),
    (
        "weights-retyped",
        lambda: rewrite_weights(EXPORT, lambda t: t.update({k: v.half() for k, v in t.items()})),
        EVAL,
        "model.safetensors",
    ),
    (
        "weights-tensor-missing",
        lambda: rewrite_weights(EXPORT, lambda t: t.pop(sorted(t)[0])),
        EVAL,
        "model.safetensors",
    ),
    ("metadata-missing", lambda: (EXPORT / "clipkit.json").unlink(), EVAL, "clipkit.json"),
    ("metadata-invalid-json", lambda: (EXPORT / "clipkit.json").write_text("{oops"), EVAL, "clipkit.json"),
    ("metadata-empty", lambda: (EXPORT / "clipkit.json").write_text(""), EVAL, "clipkit.json"),
    ("metadata-not-utf8", lambda: (EXPORT / "clipkit.json").write_bytes(b"\xff\xfe{}"), EVAL, "clipkit.json"),
    ("metadata-a-list", lambda: (EXPORT / "clipkit.json").write_text("[1, 2]"), EVAL, "clipkit.json"),
    (
        "metadata-incomplete",
        lambda: edit_json(EXPORT / "clipkit.json", lambda m: m.pop("recipe")),
        EVAL,
        "clipkit.json",
    ),
    (
        "metadata-plugins-broken",
        lambda: edit_json(EXPORT / "clipkit.json", lambda m: m.update(plugins={"loss": 3})),
        EVAL,
        "clipkit.json",
    ),
    (
        "metadata-checksums-broken",
        lambda: edit_json(EXPORT / "clipkit.json", lambda m: m.update(files="x")),
        EVAL,
        "clipkit.json",
    ),
    (
        "metadata-recipe-invalid",
        lambda: edit_json(EXPORT / "clipkit.json", lambda m: m["recipe"]["train"].update(log_every=0)),
        EVAL,
        "clipkit.json",
    ),
    (
        "metadata-recipe-other-model",
        lambda: edit_json(EXPORT / "clipkit.json", lambda m: m["recipe"]["model"].update(embed_dim=24)),
        EVAL,
        "model.safetensors",
    ),
    (
        "metadata-plugin-kind-unknown",
        lambda: edit_json(
            EXPORT / "clipkit.json", lambda m: m["plugins"]["model.tokenizer"].update(kind="tokenzier")
        ),
        EVAL,
        "plugins.model.tokenizer names an unknown plugin kind 'tokenzier' "
        "(known kinds: distill_loss, encoder,",
    ),
    (  # loaded, and described as a KME model while the recipe built the dot-product one
        "metadata-plugin-name-not-the-recipes",
        lambda: edit_json(EXPORT / "clipkit.json", lambda m: m["plugins"]["similarity"].update(name="kme")),
        EVAL,
        "clipkit.json: plugins.similarity.name is 'kme' but its recipe's similarity.name is 'dot'",
    ),
    (
        "metadata-plugin-slot-dropped",
        lambda: edit_json(EXPORT / "clipkit.json", lambda m: m["plugins"].pop("similarity")),
        EVAL,
        "clipkit.json: plugins.similarity.name is None but its recipe's similarity.name is 'dot'",
    ),
    (
        "metadata-files-entry-outside",
        lambda: edit_json(EXPORT / "clipkit.json", lambda m: m["files"].update({"../../x": {"sha256": "0"}})),
        EVAL,
        "clipkit.json: files entry '../../x' points outside the export",
    ),
    # --- checkpoints (train --resume, export)
    ("state-truncated", lambda: truncate(CKPT / "state.pt"), RESUME, "state.pt"),
    ("state-flipped-byte", lambda: flip_byte(CKPT / "state.pt"), RESUME, "state.pt"),
    (
        "state-garbage",
        lambda: ((CKPT / "state.pt").write_bytes(b"not a zip"), rechecksum_checkpoint(CKPT)),
        RESUME,
        "state.pt",
    ),
    ("state-a-list", lambda: rewrite_state(CKPT, lambda s: [1, 2]), RESUME, "state.pt"),
    (
        "state-key-missing",
        lambda: rewrite_state(CKPT, lambda s: s.pop("schedule") and None),
        RESUME,
        "state.pt",
    ),
    (
        "state-other-model",
        lambda: rewrite_state(CKPT, lambda s: s["model"].update({k: v[:1] for k, v in s["model"].items()})),
        RESUME,
        "state.pt",
    ),
    (
        "state-crafted-pickle",
        lambda: (
            torch.save({"step": 2, "x": Marker(Path("ran"))}, CKPT / "state.pt"),
            rechecksum_checkpoint(CKPT),
        ),
        RESUME,
        "state.pt",
    ),
    (
        "rng-crafted-pickle",
        lambda: (
            torch.save({"format": 1, "x": Marker(Path("ran"))}, CKPT / "rng-0.pt"),
            rechecksum_checkpoint(CKPT),
        ),
        RESUME,
        "rng-0.pt",
    ),
    (
        "export-state-crafted-pickle",
        lambda: (
            torch.save({"step": 2, "x": Marker(Path("ran"))}, CKPT / "state.pt"),
            rechecksum_checkpoint(CKPT),
        ),
        EXPORT_CMD,
        "state.pt",
    ),
    ("rng-missing", lambda: (CKPT / "rng-0.pt").unlink(), RESUME, "rng-0.pt"),
    ("rng-truncated", lambda: (truncate(CKPT / "rng-0.pt"), rechecksum_checkpoint(CKPT)), RESUME, "rng-0.pt"),
    (
        "rng-malformed",
        lambda: (torch.save({"format": 1, "python": 3}, CKPT / "rng-0.pt"), rechecksum_checkpoint(CKPT)),
        RESUME,
        "rng-0.pt",
    ),
    ("ckpt-manifest-invalid", lambda: (CKPT / "checkpoint.json").write_text("{"), RESUME, "checkpoint.json"),
    (
        "ckpt-manifest-lists-missing-file",
        lambda: edit_json(CKPT / "checkpoint.json", lambda m: m["files"].update({"x.pt": {"sha256": "0"}})),
        RESUME,
        "x.pt",
    ),
    (
        "run-recipe-bad-yaml",
        lambda: Path("run/recipe.yaml").write_text("train: [1,\n"),
        RESUME,
        "recipe.yaml",
    ),
    (
        "ckpt-manifest-lists-outside-file",
        lambda: edit_json(
            CKPT / "checkpoint.json", lambda m: m["files"].update({"../../../x": {"sha256": "0"}})
        ),
        RESUME,
        "files entry '../../../x' points outside the checkpoint",
    ),
    ("export-state-truncated", lambda: truncate(CKPT / "state.pt"), EXPORT_CMD, "state.pt"),
    (
        "export-state-other-model",
        lambda: rewrite_state(CKPT, lambda s: s["model"].update({k: v[:1] for k, v in s["model"].items()})),
        EXPORT_CMD,
        "state.pt",
    ),
    ("export-state-flipped", lambda: flip_byte(CKPT / "state.pt"), EXPORT_CMD, "state.pt"),
    # --- shard manifests (shard --verify)
    ("manifest-invalid-json", damage_manifest(lambda p: p.write_text("{")), VERIFY, "manifest.json"),
    ("manifest-empty", damage_manifest(lambda p: p.write_text("")), VERIFY, "manifest.json"),
    ("manifest-not-utf8", damage_manifest(lambda p: p.write_bytes(b"\xff{}")), VERIFY, "manifest.json"),
    ("manifest-a-list", damage_manifest(lambda p: p.write_text("[]")), VERIFY, "manifest.json"),
    (
        "manifest-escaping-name",
        damage_manifest(lambda p: edit_json(p, lambda m: m["shards"][0].update(name="../../x.tar"))),
        VERIFY,
        "manifest.json",
    ),
    (
        "manifest-counts-disagree",
        damage_manifest(lambda p: edit_json(p, lambda m: m.update(n=m["n"] + 1))),
        VERIFY,
        "manifest.json",
    ),
    # --- recipes (validate FILE / overrides)
    ("recipe-yaml-syntax", write_recipe(b"train:\n  steps: [1,\n"), ("validate", "bad.yaml"), "bad.yaml"),
    ("recipe-a-list", write_recipe(b"- a\n- b\n"), ("validate", "bad.yaml"), "bad.yaml"),
    ("recipe-not-utf8", write_recipe(b"name: \xff\n"), ("validate", "bad.yaml"), "bad.yaml"),
    (
        "recipe-bad-interpolation",
        write_recipe(b"seed: ${nowhere}\n"),
        ("validate", "bad.yaml"),
        "seed",
    ),
    ("override-yaml-syntax", lambda: None, ("validate", SMOKE, "train.steps=[1,"), "train.steps=[1,"),
    (
        "tasks-file-bad-yaml",
        write_recipe(b"- {name: zero_shot\n"),
        ("eval", "run/export", "--tasks", "bad.yaml"),
        "bad.yaml",
    ),
    (
        "tasks-file-env-resolver",
        write_recipe(b"- {name: retrieval, data: '${oc.env:HOME}'}\n"),
        ("eval", "run/export", "--tasks", "bad.yaml"),
        "0.data: the resolver ${oc.env:...} is not allowed",
    ),
]


def test_the_matrix_covers_at_least_25_damages_of_every_kind():
    assert len(DAMAGES) >= 25 and len({d[0] for d in DAMAGES}) == len(DAMAGES)
    commands = {d[2][0] for d in DAMAGES}
    assert {"eval", "train", "export", "shard", "validate"} <= commands


@pytest.mark.parametrize(
    ("damage", "command", "names"), [d[1:] for d in DAMAGES], ids=[d[0] for d in DAMAGES]
)
def test_a_damaged_artifact_is_one_clear_error(work, app, damage, command, names):
    damage()
    result = invoke(app, *command)
    assert_clean_failure(result, names)
    assert not Path("ran").exists()


def test_debug_shows_the_traceback(work, app):
    truncate(EXPORT / "model.safetensors")
    plain = invoke(app, *EVAL)
    debug = invoke(app, "--debug", *EVAL)
    assert plain.exit_code == debug.exit_code == 2
    assert "Traceback" not in plain.output and "Traceback" in debug.output
    assert "IntegrityError" in debug.output


# ----------------------------------------------------------------------------- crafted pickles


def craft_checkpoint(checkpoint: Path, marker: Path, file: str) -> None:
    """Replace one file with a payload, its checksum updated: only never-unpickling can stop it."""
    payload = {"step": 2, "x": Marker(marker)} if file == "state.pt" else {"format": 1, "x": Marker(marker)}
    torch.save(payload, checkpoint / file)
    rechecksum_checkpoint(checkpoint)


@pytest.mark.slow  # real processes, ~20 s (the matrix checks the same in-process)
@pytest.mark.parametrize(
    ("file", "commands"),
    [("state.pt", (RESUME, EXPORT_CMD)), ("rng-0.pt", (RESUME,))],  # export reads no RNG state
)
def test_a_crafted_pickle_never_runs_on_resume_or_export(work, file, commands):
    """In real processes, as a user would run them: the payload would create a marker file."""
    marker = work / "payload-ran"
    for checkpoint in sorted((work / "run" / "checkpoints").iterdir()):
        craft_checkpoint(checkpoint, marker, file)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for command in (RESUME, EXPORT_CMD):
        done = warm_launch.subprocess_run([sys.executable, "-m", "clipkit", *command], cwd=work, env=env)
        output = done.stdout + done.stderr
        assert not marker.exists(), f"{' '.join(command)} ran the payload"
        if command not in commands:
            assert done.returncode == 0, output
            continue
        assert done.returncode == 2, output
        assert file in output and "unpickl" in output and "--trust-checkpoint" in output
        assert "Traceback" not in output


@pytest.mark.slow
def test_checkpoints_of_older_clipkit_load_only_with_trust_checkpoint(work, app):
    """An older clipkit pickled numpy's RNG state: refused by default, loaded with --trust-checkpoint."""
    from clipkit.train.runtime import rng_state

    torch.save(rng_state(), CKPT / "rng-0.pt")  # the old format: numpy arrays inside
    rechecksum_checkpoint(CKPT)
    refused = invoke(app, *RESUME)
    assert_clean_failure(refused, "rng-0.pt")
    assert "numpy" in refused.output and "--trust-checkpoint" in refused.output
    trusted = invoke(app, *RESUME, "--trust-checkpoint")
    assert trusted.exit_code == 0, trusted.output


def test_deepspeed_files_are_checked_before_deepspeed_unpickles_them(tmp_path):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from clipkit.artifacts.integrity import loading
    from clipkit.errors import UnsafeCheckpointError
    from clipkit.train.runtime.partitions import check_files

    zero = tmp_path / "deepspeed" / "zero"
    zero.mkdir(parents=True)
    # What ZeRO optimiser files hold: tensors, the stage enum, the loss scaler.
    torch.save(
        {"stage": ZeroStageEnum.gradients, "scaler": LossScaler(1.0), "w": torch.ones(2)}, zero / "ok.pt"
    )
    check_files(tmp_path)
    marker = tmp_path / "ran"
    torch.save({"x": Marker(marker)}, zero / "evil.pt")
    with pytest.raises(UnsafeCheckpointError, match="evil.pt"):
        check_files(tmp_path)
    assert not marker.exists()
    with loading(trust_checkpoint=True):
        check_files(tmp_path)  # trusted: not read here (DeepSpeed reads it)
    assert not marker.exists()


# ----------------------------------------------------------------------------- integrity


def test_every_flipped_byte_is_detected(work, app):
    """Bytes flipped at spread positions of the weights and of each checkpoint file: 0 undetected."""
    chooser = random.Random(19)
    targets = [(EXPORT / "model.safetensors", EVAL), (CKPT / "state.pt", RESUME), (CKPT / "rng-0.pt", RESUME)]
    for path, command in targets:
        original = path.read_bytes()
        size = len(original)
        for position in [0, size - 1, *(chooser.randrange(size) for _ in range(4))]:
            flip_byte(path, position)
            result = invoke(app, *command)
            assert_clean_failure(result, path.name)
            assert "sha256 mismatch" in result.output, (path, position, result.output)
            path.write_bytes(original)


def test_no_verify_skips_the_checksum(work, app):
    """A flipped byte inside a tensor's data is caught only by the checksum; --no-verify loads it."""
    from safetensors import safe_open

    weights = EXPORT / "model.safetensors"
    with safe_open(str(weights), framework="pt") as handle:
        assert handle.keys()
    header = 8 + int.from_bytes(weights.read_bytes()[:8], "little")
    flip_byte(weights, header + 3)  # inside the first tensor's bytes, not the header
    assert invoke(app, *EVAL).exit_code == 2
    result = invoke(app, *EVAL, "--no-verify")
    assert result.exit_code == 0, result.output


def test_exports_and_checkpoints_record_checksums_of_their_files(work):
    metadata = json.loads((EXPORT / "clipkit.json").read_text())
    assert metadata["files"] == describe_files(EXPORT, ["model.safetensors"])
    manifest = json.loads((CKPT / "checkpoint.json").read_text())
    assert sorted(manifest["files"]) == ["rng-0.pt", "state.pt"]
    assert manifest["files"]["state.pt"] == describe_files(CKPT, ["state.pt"])["state.pt"]


def test_an_export_without_checksums_loads_with_a_one_line_warning(work, app, caplog):
    edit_json(EXPORT / "clipkit.json", lambda m: m.pop("files"))
    with caplog.at_level("WARNING", logger="clipkit.artifacts.integrity"):
        result = invoke(app, *EVAL)
    assert result.exit_code == 0, result.output
    warnings = [r.getMessage() for r in caplog.records if "no checksums" in r.getMessage()]
    assert len(warnings) == 1 and "clipkit.json" in warnings[0] and "\n" not in warnings[0]


def flip_tensor_byte(weights: Path) -> None:
    """Flip a byte inside the first tensor's data (the header still parses: only a checksum sees it)."""
    header = 8 + int.from_bytes(weights.read_bytes()[:8], "little")
    flip_byte(weights, header + 3)


@pytest.mark.parametrize(
    "files", [{}, {"recipe.yaml": {"sha256": "0" * 64}}], ids=["files-empty", "weights-not-listed"]
)
def test_an_export_listing_no_checksum_for_its_weights_is_refused(work, app, files):
    """`files: {}` with flipped weight bytes was evaluated with exit 0: only an export with no
    `files` key at all (written before checksums) may load unverified."""
    edit_json(EXPORT / "clipkit.json", lambda m: m.update(files=files))
    flip_tensor_byte(EXPORT / "model.safetensors")
    before = (EXPORT / "model.safetensors").read_bytes()
    result = invoke(app, *EVAL)
    assert_clean_failure(result, "model.safetensors: no checksum in clipkit.json")
    (line,) = [text for text in result.output.splitlines() if text.strip()]
    assert "--no-verify" in line and not Path("report.json").exists()
    assert (EXPORT / "model.safetensors").read_bytes() == before  # nothing changed


def test_a_checkpoint_manifest_listing_no_checksum_for_state_is_refused(work, app):
    edit_json(CKPT / "checkpoint.json", lambda m: m["files"].pop("state.pt"))
    assert_clean_failure(invoke(app, *EXPORT_CMD), "state.pt: no checksum in checkpoint.json")
    assert not Path("out").exists()


def test_an_export_from_before_checksums_warns_every_time_it_loads(work, app, caplog):
    edit_json(EXPORT / "clipkit.json", lambda m: m.pop("files"))
    with caplog.at_level("WARNING", logger="clipkit.artifacts.integrity"):
        for _ in range(2):
            assert invoke(app, *EVAL).exit_code == 0
    warnings = [r.getMessage() for r in caplog.records if "no checksums" in r.getMessage()]
    assert len(warnings) == 2 and all("\n" not in w for w in warnings)


@pytest.mark.slow
def test_resume_is_exact_with_checksummed_tensor_rng_states(work):
    """Resuming from step 1 ends at the uninterrupted run's step-2 weights (RNG states restored)."""
    from clipkit.train.checkpoint import load_checkpoint

    expected = load_checkpoint(CKPT)
    shutil.rmtree(CKPT)
    # A process like the one that trained (same thread count: float reductions depend on it).
    command = [sys.executable, "-m", "clipkit", "train", SMOKE, "--resume", "--run-dir", "run"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = warm_launch.subprocess_run(command, cwd=work, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    got = load_checkpoint(CKPT)
    for key, tensor in expected["model"].items():
        assert torch.equal(got["model"][key], tensor), key


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path):
    import numpy as np

    from clipkit.train.checkpoint import load_rng, save_rng
    from clipkit.train.runtime import rng_state, set_rng_state

    random.random(), np.random.normal(), torch.randn(1)  # leave gauss caches filled
    save_rng(tmp_path, 0, rng_state())
    expected = (random.random(), np.random.normal(), torch.randn(3))
    set_rng_state(load_rng(tmp_path, 0))
    got = (random.random(), np.random.normal(), torch.randn(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])
    torch.load(tmp_path / "rng-0.pt", weights_only=True)  # plain types and tensors only


# ----------------------------------------------------------------------------- permissions


def test_export_files_get_the_umask_permissions(work, app):
    old = os.umask(0o022)
    try:
        result = invoke(app, *EXPORT_CMD)
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    for name in ("model.safetensors", "clipkit.json"):
        assert stat.S_IMODE(os.stat(Path("out") / name).st_mode) == 0o644, name
    assert stat.S_IMODE(os.stat("out").st_mode) == 0o755


@pytest.mark.parametrize("command", [RESUME, EXPORT_CMD], ids=["resume", "export"])
def test_no_verify_skips_the_checkpoint_manifest(work, app, command):
    """A manifest listing a file that is not there stops resume and export, unless --no-verify."""
    edit_json(CKPT / "checkpoint.json", lambda m: m["files"].update({"gone.pt": {"sha256": "0" * 64}}))
    assert_clean_failure(invoke(app, *command), "gone.pt")
    result = invoke(app, *command, "--no-verify")
    assert result.exit_code == 0, result.output


# ----------------------------------------------------------------------------- contained exports


def outside_file(tmp_path: Path) -> tuple[Path, str]:
    """A file outside the export (as /etc/passwd would be) and its sha256."""
    secret = tmp_path.parent / f"{tmp_path.name}-outside.txt"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n")
    return secret, describe_files(secret.parent, [secret.name])[secret.name]["sha256"]


@pytest.mark.parametrize("how", ["dot-dot", "absolute", "symlink"])
def test_an_export_reads_no_file_outside_it(work, app, how):
    """A `files` entry leading out of the export (``..``, an absolute path, a symlink inside it)
    is refused by name before the file is read: nothing of it (not even part of its hash) is printed."""
    secret, digest = outside_file(work)
    if how == "symlink":
        (EXPORT / "notes.txt").symlink_to(secret)
        name = "notes.txt"
    else:
        name = os.path.relpath(secret, EXPORT) if how == "dot-dot" else str(secret)
    edit_json(EXPORT / "clipkit.json", lambda m: m["files"].update({name: {"sha256": "0" * 64}}))
    result = invoke(app, *EVAL)
    assert_clean_failure(result, f"files entry {name!r} points outside the export")
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert digest[:8] not in result.output and not Path("report.json").exists()


@pytest.mark.parametrize("relative", [True, False], ids=["dot-dot", "absolute"])
def test_a_tokenizer_vocab_outside_the_export_is_refused(work, app, relative):
    secret, _ = outside_file(work)
    secret.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nroot\n")
    vocab = os.path.relpath(secret, EXPORT) if relative else str(secret)

    def point_outside(metadata: dict) -> None:
        tokenizer = {"name": "wordpiece", "vocab": vocab, "context_length": 16}
        metadata["recipe"]["model"]["tokenizer"] = tokenizer
        metadata["plugins"]["model.tokenizer"].update(name="wordpiece", kwargs={"vocab": vocab})

    edit_json(EXPORT / "clipkit.json", point_outside)
    result = invoke(app, *EVAL)
    assert_clean_failure(result, f"model.tokenizer.vocab {vocab!r} points outside the export")
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_an_export_carries_its_own_wordpiece_vocab(tmp_path, monkeypatch, registry):
    """A recipe's vocab.txt is copied into the export (checksummed), so the export loads with the
    original file gone and reads nothing outside itself."""
    from clipkit.artifacts.export import write_export
    from clipkit.artifacts.reader import load_export
    from clipkit.config.recipe import load_recipe
    from clipkit.model import build_model

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "a", "red", "square", "##s"]) + "\n")
    monkeypatch.chdir(tmp_path)
    tokenizer = f"model.tokenizer={{name: wordpiece, vocab: {vocab}, context_length: 8}}"
    recipe = load_recipe(SMOKE, [tokenizer], registry=registry)
    model = build_model(recipe, registry)
    expected = model.tokenizer(["a red squares"])
    write_export(model, recipe, tmp_path / "export", registry)
    vocab.unlink()
    metadata = json.loads((tmp_path / "export" / "clipkit.json").read_text())
    assert metadata["recipe"]["model"]["tokenizer"]["vocab"] == "tokenizer-vocab"
    assert "tokenizer-vocab" in metadata["files"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    loaded, _ = load_export(tmp_path / "export", registry)
    assert torch.equal(loaded.tokenizer(["a red squares"]), expected)


def test_an_export_does_not_read_init_weights_its_recipe_names(tmp_path, monkeypatch, registry):
    """A text tower's ``weights`` (a Hugging Face checkpoint to start from) is not read when the
    model is rebuilt from an export, whose own weights replace it: a path leading out is never opened."""
    from clipkit.artifacts.export import write_export
    from clipkit.artifacts.reader import load_export
    from clipkit.config.recipe import load_recipe
    from clipkit.model import build_model

    monkeypatch.chdir(tmp_path)
    recipe = load_recipe(SMOKE, ["model.text_encoder=distilbert_tiny"], registry=registry)
    write_export(build_model(recipe, registry), recipe, tmp_path / "export", registry)
    secret, _ = outside_file(tmp_path)
    edit_json(
        tmp_path / "export" / "clipkit.json",
        lambda m: m["recipe"]["model"]["text_encoder"].update(weights=str(secret)),
    )
    model, _ = load_export(tmp_path / "export", registry)
    assert model.encode_text(model.tokenizer(["a red square"])).points.shape[0] == 1
