"""Own-data runs sized by epochs (clipkit.app.run_length): defaults, the start line, the short-run note."""

from __future__ import annotations

import json
import math

import pytest
from test_own_data_flow import write_drawings
from typer.testing import CliRunner

from clipkit.app import own_data_defaults as defaults
from clipkit.app.cli import make_app
from clipkit.app.own_data import is_held_out
from clipkit.app.run_length import (
    RunLength,
    plan_line,
    sets_steps,
    short_run_note,
    sized_by_epochs,
    steps_for,
)
from clipkit.errors import ClipkitError


def test_tiny_variants_are_sized_by_epochs():
    assert sized_by_epochs("clip@tiny") and sized_by_epochs("wpse@imq+tiny") and sized_by_epochs("quickstart")
    assert not sized_by_epochs("clip") and not sized_by_epochs("clip@b32") and not sized_by_epochs("my.yaml")


def test_steps_for_epochs_round_up_and_cap():
    assert steps_for(10, 3000, 64) == 469  # ceil(30 000 / 64)
    assert steps_for(0.01, 100, 64) == 1  # never zero steps
    assert steps_for(10, 1_000_000, 64, cap=2000) == 2000
    with pytest.raises(ClipkitError, match="--epochs must be > 0"):
        steps_for(0, 100, 64)


def test_the_default_length_is_a_compute_budget_not_epochs():
    """96 000 pairs whatever the table's size (1 500 steps of 64), at most 200 passes over a small one."""
    assert defaults.BUDGET_SAMPLES == 96_000 and defaults.MAX_EPOCHS == 200
    assert defaults.budget_steps(2821, 64) == 1500  # the table: 34 epochs, not 10
    assert defaults.budget_steps(1_000_000, 64) == 1500  # a big table: under one epoch (and told so)
    assert defaults.budget_steps(96, 64) == math.ceil(200 * 96 / 64)  # a small one: 200 epochs
    assert defaults.budget_steps(1, 1) == 200


def test_user_steps_are_recognised():
    assert sets_steps(["data.batch_size=8", "train.steps=5"]) and sets_steps(["+train.steps=5"])
    assert not sets_steps(["train.steps_per_eval=5", "data.batch_size=8"])


def test_plan_line_and_short_run_note():
    assert plan_line(RunLength(469, 64, 3000)).startswith("train: 469 steps = 10 epochs of your 3000 samples")
    short = plan_line(RunLength(20, 64, 2850))  # the case: 20 steps of 64 over 2 850 rows
    assert "20 steps = 0.449 epochs of your 2850 samples" in short and "under one epoch" in short
    assert "0.45 of an epoch" in short_run_note({"epoch": 0.449})
    assert short_run_note({"epoch": 1.0}) is None and short_run_note({}) is None


def test_several_processes_never_shard_before_training(in_tmp, monkeypatch, registry):
    """Under a launcher every process runs the sizing before any can wait for another: a table not
    yet sharded keeps the recipe's steps (process 0 shards it during training); shards made
    before the launch are counted."""
    from clipkit.app import api
    from clipkit.app.run_length import plan

    table = write_drawings(in_tmp, n=40)
    overrides = [f"data.source={in_tmp / table}", f"data.shards={in_tmp / 'shards'}"]
    recipe = api.resolve("clip@tiny", overrides, registry)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert plan(recipe, registry, epochs=None, by_default=True) is None
    assert not (in_tmp / "shards").exists()
    monkeypatch.setenv("WORLD_SIZE", "1")
    length = plan(recipe, registry, epochs=2, by_default=True)
    assert (length.num_samples, length.batch_size, length.steps) == (40, 40, 2)  # fit_batch: 40 rows
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert plan(recipe, registry, epochs=2, by_default=True).steps == 2  # shards there: counted


def test_epochs_without_data_is_refused():
    outcome = CliRunner().invoke(make_app(), ["train", "clip@tiny", "--epochs", "3"])
    assert outcome.exit_code == 2 and "--epochs counts passes over your --data" in outcome.output


def sized(in_tmp, registry, user: list[str], n: int = 40):
    """(clip@tiny on an n-row table sized and set by its own-data defaults, the printed lines)."""
    from clipkit.app import api
    from clipkit.app.run_length import size_run

    table = write_drawings(in_tmp, n=n)
    overrides = [f"data.source={in_tmp / table}", f"data.shards={in_tmp / 'shards'}", *user]
    recipe = api.resolve("clip@tiny", overrides, registry)
    return size_run("clip@tiny", recipe, user, None, registry)


def test_tiny_defaults_on_your_data_without_the_pretrained_tower(in_tmp, registry, monkeypatch):
    monkeypatch.setattr(defaults, "has_minilm", lambda: False)
    recipe, lines = sized(in_tmp, registry, [])
    steps = defaults.budget_steps(40, 40)  # fit_batch: 40 rows, one batch
    assert recipe["train"]["steps"] == steps == 200
    assert recipe["schedule"]["warmup_steps"] == round(0.05 * steps)
    assert list(recipe["data"]["crop_scale"]) == [0.8, 1.0]
    assert recipe["model"]["text_encoder"]["name"] == "text_transformer_tiny"  # the recipe's own
    assert defaults.MINILM_PIP in lines and lines.splitlines()[-1].startswith(f"train: {steps} steps")


def test_your_own_settings_win_over_the_tiny_defaults(in_tmp, registry, monkeypatch):
    monkeypatch.setattr(defaults, "has_minilm", lambda: True)
    user = ["data.crop_scale=[1.0, 1.0]", "schedule.warmup_steps=7", "train.steps=30",
            "model.text_encoder={name: text_transformer_tiny}"]  # fmt: skip
    recipe, lines = sized(in_tmp, registry, user)
    assert recipe["train"]["steps"] == 30 and recipe["schedule"]["warmup_steps"] == 7
    assert list(recipe["data"]["crop_scale"]) == [1.0, 1.0]
    assert recipe["model"]["text_encoder"]["name"] == "text_transformer_tiny"
    assert "text:" not in lines


def test_tiny_defaults_take_the_pretrained_text_tower_when_installed(in_tmp, registry):
    pytest.importorskip(defaults.MINILM_PACKAGE)
    recipe, lines = sized(in_tmp, registry, [])
    assert recipe["model"]["text_encoder"] == {"name": "minilm_l6", "frozen": True}
    assert (
        recipe["model"]["tokenizer"]["name"] == "wordpiece"
        and recipe["model"]["tokenizer"]["vocab"] == "minilm"
    )
    assert "all-MiniLM-L6-v2" in lines


def test_recipes_without_a_scratch_text_tower_keep_theirs():
    assert not defaults.takes_text_tower({"model": {"pair": "two_view", "text_encoder": None}})
    assert not defaults.takes_text_tower({"model": {"text_encoder": {"name": "minilm_l6"}}})
    assert defaults.takes_text_tower({"model": {"text_encoder": {"name": "distilbert_tiny"}}})
    point_set = {"name": "text_transformer_tiny", "output": "tokens", "pad_points": "include"}  # WPSE
    assert not defaults.takes_text_tower({"model": {"text_encoder": point_set}})
    assert defaults.user_sets(["model.text_encoder.frozen=false"], "model.text_encoder")
    assert defaults.user_sets(["model={embed_dim: 8}"], "model.text_encoder")
    assert not defaults.user_sets(["model.text_encoder_x=1"], "model.text_encoder")


def test_tiny_defaults_say_how_to_get_the_pretrained_image_tower(in_tmp, registry, monkeypatch):
    monkeypatch.setattr(defaults, "has_minilm", lambda: False)
    recipe, lines = sized(in_tmp, registry, [])
    assert recipe["model"]["image_encoder"]["name"] == "vit_tiny" and recipe["model"]["image_size"] == 48
    assert defaults.PRETRAINED_IMAGE_PIP in lines


@pytest.mark.pretrained_image_tower
def test_tiny_defaults_take_the_pretrained_image_tower_when_installed(in_tmp, registry, monkeypatch):
    """With the package (pretended here: the tower is not built), the locked EfficientNet-Lite0 at
    224 px on uncropped images replaces vit_tiny; the user's own image settings still win."""
    monkeypatch.setattr(defaults, "has_pretrained_image_tower", lambda: True)
    recipe, lines = sized(in_tmp, registry, [])
    assert recipe["model"]["image_encoder"] == {"name": "efficientnet_lite0", "frozen": True}
    assert recipe["model"]["image_size"] == 224 and list(recipe["data"]["crop_scale"]) == [1.0, 1.0]
    assert "EfficientNet-Lite0" in lines
    # Only projections train on its fixed features: 10 passes over the 40 rows (one batch of 40).
    assert recipe["train"]["steps"] == defaults.budget_steps(40, 40, 10) == 10
    recipe, lines = sized(in_tmp, registry, ["model.image_size=64"])
    assert recipe["model"]["image_encoder"]["name"] == "vit_tiny" and "image:" not in lines
    assert list(recipe["data"]["crop_scale"]) == [0.8, 1.0]  # a scratch tower keeps the mild crops
    recipe, _ = sized(in_tmp, registry, ["data.crop_scale=[0.5, 1.0]"])
    assert recipe["model"]["image_encoder"]["name"] == "efficientnet_lite0"
    assert list(recipe["data"]["crop_scale"]) == [0.5, 1.0]  # the user's wins (features then not cached)


@pytest.mark.pretrained_image_tower
def test_with_both_pretrained_towers_the_text_keeps_its_sentence_space(in_tmp, registry, monkeypatch):
    """Both packages (pretended: no tower is built): MiniLM unprojected, embed_dim its 384, said at
    the start; the user's own model.embed_dim keeps the projection."""
    monkeypatch.setattr(defaults, "has_pretrained_image_tower", lambda: True)
    monkeypatch.setattr(defaults, "has_minilm", lambda: True)
    recipe, lines = sized(in_tmp, registry, [])
    assert recipe["model"]["text_encoder"] == {"name": "minilm_l6", "frozen": True, "projection": False}
    assert recipe["model"]["embed_dim"] == defaults.MINILM_WIDTH == 384
    assert recipe["model"]["image_encoder"]["name"] == "efficientnet_lite0"
    text_lines = [line for line in lines.splitlines() if line.startswith("text:")]
    assert len(text_lines) == 1 and "unprojected" in text_lines[0] and "sentence space" in text_lines[0]
    recipe, lines = sized(in_tmp, registry, ["model.embed_dim=128"])
    assert recipe["model"]["text_encoder"] == {"name": "minilm_l6", "frozen": True}
    assert recipe["model"]["embed_dim"] == 128 and "sentence space" not in lines
    monkeypatch.setattr(defaults, "has_pretrained_image_tower", lambda: False)
    recipe, lines = sized(in_tmp, registry, [])  # a scratch image tower: MiniLM keeps its projection
    assert recipe["model"]["text_encoder"] == {"name": "minilm_l6", "frozen": True}
    assert recipe["model"]["embed_dim"] == 64 and "sentence space" not in lines


def test_only_pooled_scratch_image_towers_are_replaced(registry):
    from clipkit.app import api
    from clipkit.config.recipe import amend_resolved, validate_or_raise

    for spec in ("clip@tiny", "siglip@tiny", "cloob@tiny", "nuclr@tiny", "quickstart"):
        recipe = api.resolve(spec, [], registry)
        assert defaults.takes_image_tower(recipe), spec
        overrides = list(defaults.PRETRAINED_IMAGE_OVERRIDES)
        validate_or_raise(amend_resolved(recipe, overrides, kept=[], where=spec), registry)
    for spec in ("wpse@tiny", "kme_clip@tiny", "yaware@tiny", "clip"):
        assert not defaults.takes_image_tower(api.resolve(spec, [], registry)), spec
    assert not defaults.takes_image_tower(
        {"model": {"image_encoder": {"name": "vit_tiny", "output": "tokens"}}}
    )


@pytest.mark.slow
def test_own_data_run_lasts_epochs_and_a_short_one_says_so(in_tmp):
    """`clipkit train clip@tiny --data TABLE --epochs 2`: 2 epochs over the training rows, said at
    the start; `train.steps=1` (under one epoch) is kept, and the last line and the report say it
    was short."""
    runner, app = CliRunner(), make_app()
    table = write_drawings(in_tmp, n=96)
    kept = 96 - sum(is_held_out(str(i), 0.05) for i in range(96))
    quick = ["data.num_workers=0", "train.memory_check=false", "train.checkpoint_every=100"]
    outcome = runner.invoke(
        app, ["train", "clip@tiny", "--data", table, "--epochs", "2", "--run-dir", "run", *quick]
    )
    assert outcome.exit_code == 0, outcome.output
    steps = math.ceil(2 * kept / 64)
    assert f"train: {steps} steps = {steps * 64 / kept:.3g} epochs of your {kept} samples" in outcome.output
    last = json.loads((in_tmp / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == steps and last["epoch"] >= 2
    assert "note:" not in outcome.output and "Note" not in (in_tmp / "run" / "eval.md").read_text()
    short = runner.invoke(
        app, ["train", "clip@tiny", "--data", table, "--run-dir", "run2", "train.steps=1", *quick]
    )
    assert short.exit_code == 0, short.output
    assert f"train: 1 steps = {64 / kept:.3g} epochs of your {kept} samples" in short.output
    assert (
        short.output.strip()
        .splitlines()[-1]
        .startswith(f"note: this run ended after {64 / kept:.2f} of an epoch")
    )
    assert "**Note:** this run ended after" in (in_tmp / "run2" / "eval.md").read_text()
    assert json.loads((in_tmp / "run2" / "eval.json").read_text())["notes"][0].startswith("this run ended")


@pytest.mark.parametrize("spec", ["clip@tiny", "siglip@tiny", "cloob@tiny", "nuclr@tiny", "quickstart"])
def test_the_pretrained_tower_fits_every_tiny_variant_that_takes_it(spec, registry):
    """Each pooled tiny variant with the MiniLM overrides is a valid recipe (validation checks the
    tower's own tokenizer); WPSE's and KME-CLIP's point-set towers are not replaced."""
    pytest.importorskip(defaults.MINILM_PACKAGE)
    from clipkit.app import api
    from clipkit.config.recipe import amend_resolved, validate_or_raise

    recipe = api.resolve(spec, [], registry)
    assert defaults.takes_text_tower(recipe)
    validate_or_raise(amend_resolved(recipe, list(defaults.MINILM_OVERRIDES), kept=[], where=spec), registry)


@pytest.mark.parametrize("spec", ["wpse@tiny", "kme_clip@tiny", "yaware@tiny"])
def test_point_set_and_two_view_tiny_variants_keep_their_towers(spec, registry):
    from clipkit.app import api

    assert not defaults.takes_text_tower(api.resolve(spec, [], registry))


def tar_folder(root, counts: list[int]):
    """WebDataset tars of ``counts`` image-caption samples each, with no manifest.json beside them."""
    import io
    import tarfile

    from PIL import Image

    root.mkdir()
    for number, count in enumerate(counts):
        with tarfile.open(root / f"part-{number}.tar", "w") as tar:
            for sample in range(count):
                image = io.BytesIO()
                Image.new("RGB", (8, 8), (number, sample, 0)).save(image, format="PNG")
                for name, data in (
                    (f"{number}-{sample}.png", image.getvalue()),
                    (f"{number}-{sample}.txt", b"x"),
                ):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return root


def test_a_folder_of_tars_is_sized_by_num_samples_or_its_counts(in_tmp, registry, monkeypatch):
    """`--data DIR` of tars without a manifest said "no manifest.json and no data.source" even with
    data.num_samples, where `data.shards=DIR` trains: it is sized as the loader sizes it."""
    from clipkit.app import api
    from clipkit.app.own_data import OwnData
    from clipkit.app.run_length import size_run
    from clipkit.errors import DataError

    monkeypatch.setattr(defaults, "has_minilm", lambda: False)
    folder = tar_folder(in_tmp / "tars", [3, 2])

    def length_line(user: list[str]) -> str:
        recipe = api.resolve("clip@tiny", user, registry, own_data=OwnData(data=str(folder)))
        return size_run("clip@tiny", recipe, user, 2, registry)[1]

    assert "= 2 epochs of your 5 samples" in length_line(["data.num_samples=5"])
    with pytest.raises(DataError, match=rf"{folder}: no manifest.json or sizes.json .*set data.num_samples"):
        length_line([])  # named: the folder, and what to give
    (folder / "sizes.json").write_text(json.dumps({"part-0.tar": 3, "part-1.tar": 2}))
    assert "= 2 epochs of your 5 samples" in length_line([])
    assert not (in_tmp / "data").exists()  # read in place, never sharded
