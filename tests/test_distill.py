"""Distillation (issue 39 item 2, ``train.distill``): the frozen teacher's embeddings are the export's,
``clipkit shard --teacher`` stores them and the loader reads them back bit for bit (with the view's
crop replayed from its seed), a step on stored embeddings gives the loss a live teacher gives on the
same input, training runs both ways, and the recipe checks refuse what cannot work, naming the key."""

from __future__ import annotations

import io
import json
import random
import re
import tarfile

import numpy as np
import pytest
import torch

from clipkit.app import api
from clipkit.artifacts.export import write_export
from clipkit.config.recipe import load_recipe, validate
from clipkit.contract.registry import default_registry
from clipkit.data.loader import BatchStream
from clipkit.data.teacher_shards import IMAGE_MEMBER, SEEDS_MEMBER, TEXT_MEMBER, DistillInputs, TeacherSpec
from clipkit.data.transforms import decode_transformed
from clipkit.errors import ClipkitError, DataError
from clipkit.model import build_model, build_transform
from clipkit.model.teacher import Teacher
from clipkit.train.distill import build_distillation, teacher_tokenizer
from clipkit.train.objective import build_objective
from clipkit.train.step import TrainingStep

SMOKE = "quickstart@smoke"
SOURCE = "synthetic://shapes?n=48&split=train&image_size=48"
AUGMENT = {"crop_scale": [0.5, 1.0], "hflip": True}
RECIPE_AUGMENT = ["data.crop_scale=[0.5,1.0]", "data.hflip=true"]


def recipe_for(shards, *overrides):
    return load_recipe(
        SMOKE,
        [f"data.shards={shards}", f"data.source={SOURCE}", "data.batch_size=16", "data.shuffle_buffer=0",
         "data.num_workers=0", *overrides],
        registry=default_registry(),
    )  # fmt: skip


def make_export(path, seed: int, *overrides: str):
    registry = default_registry()
    recipe = load_recipe(SMOKE, list(overrides), registry=registry)
    torch.manual_seed(seed)
    write_export(build_model(recipe, registry), recipe, path, registry)
    return path


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A teacher preprocessing and tokenizing like the student (quickstart@smoke, other weights)."""
    return make_export(tmp_path_factory.mktemp("teacher") / "export", 7)


@pytest.fixture(scope="module")
def stored(tmp_path_factory, teacher_dir):
    """SOURCE sharded with the teacher's embeddings of 2 augmented views per image."""
    out = tmp_path_factory.mktemp("stored") / "shards"
    spec = TeacherSpec(str(teacher_dir), views=2, seed=0, augment=AUGMENT, batch_size=16)
    manifest = api.shard(SOURCE, out, samples_per_shard=20, teacher=spec)
    return out, manifest


def test_teacher_embeddings_are_the_exports_own(teacher_dir):
    import clipkit

    model, _, tokenizer = clipkit.load(teacher_dir)
    teacher = Teacher.load(teacher_dir, default_registry())
    images = torch.randn(4, 3, 48, 48, generator=torch.Generator().manual_seed(0))
    tokens = tokenizer(["a red circle", "a blue square", "green", "a small yellow triangle"])
    got = teacher.embed(images, tokens)
    assert torch.equal(got.image, model.encode_image(images).points[:, 0])
    assert torch.equal(got.text, model.encode_text(tokens).points[:, 0])
    assert not any(p.requires_grad for p in teacher.model.parameters()) and not teacher.model.training
    logits = model.similarity(model.encode_image(images), model.encode_text(tokens))
    assert torch.allclose(teacher.logits(got.image, got.text), logits, rtol=1e-6, atol=1e-6)


def tar_records(directory):
    records = {}
    for path in sorted(directory.glob("shard-*.tar")):
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                key, _, field = member.name.partition(".")
                records.setdefault(key, {})[field] = tar.extractfile(member).read()
    return records


def test_stored_embeddings_are_the_teachers_and_read_back_bit_exact(stored, teacher_dir):
    out, manifest = stored
    info = manifest["info"]["teacher"]
    teacher = Teacher.load(teacher_dir, default_registry())
    assert (info["dim"], info["views"], info["seed"]) == (teacher.dim, 2, 0)
    assert info["scale"] == teacher.scale and info["augment"]["crop_scale"] == [0.5, 1.0]
    records = tar_records(out)
    assert len(records) == 48
    # Recompute what was stored, batch by batch as the writer embedded them (16 samples, 2 views each).
    transform = build_transform(recipe_for(out, *RECIPE_AUGMENT), train=True)
    keys = sorted(records)
    for start in range(0, 48, 16):
        batch = [records[key] for key in keys[start : start + 16]]
        seeds = [json.loads(r[SEEDS_MEMBER])["seeds"] for r in batch]
        assert seeds[0] == [f"aug:0:0:{start}", f"aug:0:1:{start}"]
        views = [decode_transformed(r["png"], transform, random.Random(seed), "test")[0]
                 for r, pair in zip(batch, seeds, strict=True) for seed in pair]  # fmt: skip
        expected = teacher.embed_image(torch.stack(views)).numpy()
        stored_images = np.concatenate([np.load(io.BytesIO(r[IMAGE_MEMBER])) for r in batch])
        assert stored_images.dtype == np.float32 and np.array_equal(stored_images, expected)
        captions = [c for r in batch for c in json.loads(r["json"])["captions"]]
        texts = np.concatenate([np.load(io.BytesIO(r[TEXT_MEMBER])) for r in batch])
        assert np.array_equal(texts, teacher.embed_text(teacher.tokenizer(captions)).numpy())
    # The loader hands them over unchanged: epoch 1 reads view 1, and the caption each sample draws.
    stream = BatchStream(out, batch_size=16, transform=transform, tokenizer=teacher.tokenizer, seed=0,
                         shuffle_buffer=0, distill=DistillInputs(stored=True))  # fmt: skip
    stream.restore({"epoch": 1, "batch_in_epoch": 0})
    batch = next(iter(stream))
    for row, index in enumerate(batch["index"].tolist()):
        record = records[f"{index:09d}"]
        assert torch.equal(
            batch["teacher_image"][row], torch.from_numpy(np.load(io.BytesIO(record[IMAGE_MEMBER]))[1])
        )
        assert any(torch.equal(batch["teacher_text"][row], torch.from_numpy(t))
                   for t in np.load(io.BytesIO(record[TEXT_MEMBER])))  # fmt: skip


@pytest.mark.parametrize("epoch", [0, 1])
def test_a_step_on_stored_embeddings_scores_what_the_live_teacher_scores(stored, teacher_dir, epoch):
    """Epoch e of a run seeded as the shards draws view e's crop either way (the loader's seed), so the
    live teacher sees the very images whose embeddings were stored."""
    out, _ = stored
    registry = default_registry()
    losses = ["train.distill.losses=[{name: kl, weight: 1.0}, {name: feature_cosine, weight: 0.5}]"]
    live = recipe_for(out, *RECIPE_AUGMENT, f"train.distill.teacher={teacher_dir}", *losses)
    from_shards = recipe_for(out, *RECIPE_AUGMENT, "train.distill.stored=true", *losses)
    assert validate(live, registry) == [] and validate(from_shards, registry) == []
    torch.manual_seed(0)
    model = build_model(live, registry)
    results = []
    for recipe in (live, from_shards):
        objective = build_objective(recipe, registry, model)
        distill = build_distillation(recipe, registry, objective.runtime, model.transform, str(out))
        objective.distill = distill
        stream = BatchStream(out, batch_size=16, transform=build_transform(recipe, train=True),
                             tokenizer=model.tokenizer, seed=0, shuffle_buffer=0,
                             distill=DistillInputs(stored=distill.teacher is None))  # fmt: skip
        stream.restore({"epoch": epoch, "batch_in_epoch": 0})
        batch = next(iter(stream))
        loss, out_ = TrainingStep(model, objective)(batch, 0, float(epoch))
        results.append((batch, loss, out_.metrics))
    (live_batch, live_loss, live_metrics), (stored_batch, stored_loss, stored_metrics) = results
    assert torch.equal(live_batch["image"], stored_batch["image"])  # the replayed crops
    assert "teacher_image" not in live_batch and "teacher_image" in stored_batch
    assert live_metrics["distill/kl"] > 0 and live_metrics["distill/feature_cosine"] > 0
    for key in ("distill/kl", "distill/feature_cosine", "contrastive"):
        assert float(stored_metrics[key]) == pytest.approx(float(live_metrics[key]), rel=1e-5, abs=1e-6), key
    assert stored_loss.item() == pytest.approx(live_loss.item(), rel=1e-5)
    expected = (
        live_metrics["contrastive"]
        + live_metrics["distill/kl"]
        + 0.5 * live_metrics["distill/feature_cosine"]
    )
    assert live_loss.item() == pytest.approx(float(expected), rel=1e-6)


@pytest.mark.slow
def test_training_with_a_live_teacher_of_another_width_and_size_and_with_stored_ones(
    tmp_path, stored, teacher_dir
):
    """KL needs no projection: a 32-wide teacher at 32 px teaches the 64-wide 48 px student."""
    other = make_export(tmp_path / "small-teacher", 3, "model.embed_dim=32", "model.image_size=32")
    out, _ = stored
    common = ["train.steps=2", "train.log_every=1", "train.export=false", "data.batch_size=16",
              "data.num_workers=0", *RECIPE_AUGMENT]  # fmt: skip
    runs = {
        "live": [
            f"train.distill.teacher={other}",
            f"data.source={SOURCE}",
            f"data.shards={tmp_path / 'plain'}",
        ],
        "stored": ["train.distill.stored=true", f"data.shards={out}", f"data.source={SOURCE}"],
    }
    for name, overrides in runs.items():
        api.train(SMOKE, [*common, *overrides], run_dir=tmp_path / name)
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        logged = [row for row in rows if "train/distill/kl" in row or "distill/kl" in row]
        assert logged, (name, rows[:2])


def test_feature_losses_refuse_a_teacher_of_another_width(tmp_path, stored):
    other = make_export(tmp_path / "narrow", 3, "model.embed_dim=32")
    out, _ = stored
    registry = default_registry()
    recipe = recipe_for(out, f"train.distill.teacher={other}", "train.distill.losses=[{name: feature_mse}]")
    model = build_model(recipe, registry)
    runtime = build_objective(recipe, registry, model).runtime
    with pytest.raises(ClipkitError, match="feature_mse compare.*width 32.*embed_dim 64"):
        build_distillation(recipe, registry, runtime, model.transform, str(out))


def test_stored_embeddings_refuse_another_augmentation_and_plain_shards(tmp_path, stored):
    out, _ = stored
    registry = default_registry()
    recipe = recipe_for(out, "train.distill.stored=true")  # no crop_scale / hflip: not the stored views
    model = build_model(recipe, registry)
    runtime = build_objective(recipe, registry, model).runtime
    with pytest.raises(DataError, match=r"data.crop_scale: recipe \[1.0, 1.0\], stored \[0.5, 1.0\]"):
        build_distillation(recipe, registry, runtime, model.transform, str(out))
    plain = tmp_path / "plain"
    api.shard(SOURCE, plain)
    with pytest.raises(DataError, match="no teacher embeddings.*clipkit shard SOURCE OUT --teacher"):
        build_distillation(recipe, registry, runtime, model.transform, str(plain))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [  # fmt: skip
        (["train.distill.stored=false"], "train.distill: name the teacher"),
        (["train.distill.teacher=x", "train.distill.stored=true"], "distill.teacher: stored: true reads"),
        (["train.distill.stored=true", "train.distill.losses=[{name: kld}]"], "train.distill.losses.0.name"),
        (["train.distill.stored=true", "train.distill.losses=[{name: kl, weight: -1}]"], "losses.0.weight"),
        (["train.distill.stored=true", "train.distill.losses=[{name: kl, temperature: 0}]"], "temperature"),
        (["train.distill.stored=true", "train.distill.losses=[]"], "non-empty list"),
        (["train.distill.stored=true", "train.distill.extra=1"], "train.distill.extra"),
        (["train.distill.teacher=x", "train.micro_batch_size=8"], "micro_batch_size"),
        (["train.distill.teacher=x", "train.tiled=true"], "train.tiled=false"),
        (["train.distill.teacher=x", "train.distributed.strategy=deepspeed", "train.distributed.zero_stage=3"
          ], "ZeRO-3 or FSDP2: the teacher is held whole"),
        (["train.distill.teacher=x", "train.distributed.strategy=fsdp2"], "ZeRO-3 or FSDP2"),
        (["train.distill.stored=true", "data.augment=batched"], "data.augment: sample"),
        (["train.distill.teacher=x", "model.pair=two_view"], "image-text model"),
    ],
)  # fmt: skip
def test_recipe_checks_name_the_key(overrides, message):
    registry = default_registry()
    errors = validate(load_recipe(SMOKE, overrides, registry=registry), registry)
    assert any(message in error for error in errors), errors


def test_stored_embeddings_under_zero3_are_accepted():
    registry = default_registry()
    overrides = ["train.distill.stored=true", "train.distributed.strategy=deepspeed",
                 "train.distributed.zero_stage=3"]  # fmt: skip
    assert validate(load_recipe(SMOKE, overrides, registry=registry), registry) == []


def test_shard_teacher_options_are_checked_before_anything_is_read(tmp_path, teacher_dir):
    from typer.testing import CliRunner

    from clipkit.app.cli import make_app

    runner, app = CliRunner(), make_app()
    bad = runner.invoke(app, ["shard", SOURCE, str(tmp_path / "x"), "--teacher", str(teacher_dir),
                              "--teacher-augment", "crop_scale=[0, 2]"])  # fmt: skip
    assert bad.exit_code == 2 and "data.crop_scale" in bad.output
    unknown = runner.invoke(app, ["shard", SOURCE, str(tmp_path / "x"), "--teacher", str(teacher_dir),
                                  "--teacher-augment", "image_size=3"])  # fmt: skip
    assert unknown.exit_code == 2 and "not augmentation keys" in unknown.output
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_a_hugging_face_clip_directory_teaches_through_its_own_tokenizer_and_size(tmp_path, stored):
    """An HF CLIPModel directory (clip_bpe tokens, 32 px, its own mean/std, width 16) teaches the
    hashed-words 48 px 64-wide student: the loader tokenizes each drawn caption for it and the step
    resamples the student's crop; its embeddings are those of the interop reader's model."""
    from test_interop_hf import hf_model, save_hf

    teacher_dir = save_hf(hf_model(), tmp_path / "hf")
    out, _ = stored
    registry = default_registry()
    recipe = recipe_for(out, f"train.distill.teacher={teacher_dir}")
    assert validate(recipe, registry) == []
    torch.manual_seed(0)
    model = build_model(recipe, registry)
    objective = build_objective(recipe, registry, model)
    distill = build_distillation(recipe, registry, objective.runtime, model.transform, str(out))
    teacher, objective.distill = distill.teacher, distill
    assert (teacher.dim, teacher.transform.image_size, distill.shares_tokens) == (16, 32, False)
    inputs = DistillInputs(tokenizer=teacher_tokenizer(distill))
    transform = build_transform(recipe, train=True)
    stream = BatchStream(out, batch_size=16, transform=transform, tokenizer=model.tokenizer, seed=0,
                         shuffle_buffer=0, distill=inputs)  # fmt: skip
    batch = next(iter(stream))
    assert batch["teacher_tokens"].shape[0] == 16 and not torch.equal(
        batch["teacher_tokens"][:, :16], batch["text"]
    )
    student = model.transform
    pixels = batch["image"] * torch.tensor(student.std).view(1, 3, 1, 1) + torch.tensor(student.mean).view(
        1, 3, 1, 1
    )
    resized = torch.nn.functional.interpolate(pixels, size=(32, 32), mode="bicubic", antialias=True)
    mean, std = (
        torch.tensor(teacher.transform.mean).view(1, 3, 1, 1),
        torch.tensor(teacher.transform.std).view(1, 3, 1, 1),
    )
    expected = teacher.embed((resized - mean) / std, batch["teacher_tokens"])
    got = distill.local_embeddings(batch)
    assert torch.allclose(got[0], expected.image, atol=1e-6) and torch.equal(got[1], expected.text)
    loss, out_ = TrainingStep(model, objective)(batch, 0, 0.0)
    assert out_.metrics["distill/kl"] > 0 and torch.isfinite(loss)
    loss.backward()
    assert not any(p.grad is not None for p in teacher.model.parameters())


def test_a_missing_teacher_is_named(tmp_path):
    registry = default_registry()
    recipe = recipe_for(tmp_path / "s", f"train.distill.teacher={tmp_path / 'nowhere'}")
    model = build_model(recipe, registry)
    runtime = build_objective(recipe, registry, model).runtime
    with pytest.raises(ClipkitError, match=r"train.distill.teacher: .*nowhere does not exist"):
        build_distillation(recipe, registry, runtime, model.transform, None)


def test_clipkit_shard_teacher_writes_the_views_it_is_asked_for(tmp_path, teacher_dir):
    from typer.testing import CliRunner

    from clipkit.app.cli import make_app

    out = tmp_path / "out"
    result = CliRunner().invoke(make_app(), [
        "shard", "synthetic://shapes?n=6&split=train&image_size=48", str(out), "--teacher", str(teacher_dir),
        "--teacher-views", "3", "--teacher-seed", "4", "--teacher-augment", "crop_scale=[0.6,1.0]",
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    info = json.loads((out / "manifest.json").read_text())["info"]["teacher"]
    assert (info["views"], info["seed"], info["augment"]["crop_scale"]) == (3, 4, [0.6, 1.0])
    record = tar_records(out)["000000005"]
    assert json.loads(record[SEEDS_MEMBER])["seeds"] == ["aug:4:0:5", "aug:4:1:5", "aug:4:2:5"]
    assert np.load(io.BytesIO(record[IMAGE_MEMBER])).shape == (3, info["dim"])


def test_two_entries_of_one_loss_log_apart(stored):
    out, _ = stored
    registry = default_registry()
    losses = "train.distill.losses=[{name: kl}, {name: kl, temperature: 2.0, weight: 0.5}]"
    recipe = recipe_for(out, *RECIPE_AUGMENT, "train.distill.stored=true", losses)
    model = build_model(recipe, registry)
    distill = build_distillation(recipe, registry, build_objective(recipe, registry, model).runtime,
                                 model.transform, str(out))  # fmt: skip
    assert [(e.name, e.weight, e.loss.temperature) for e in distill.losses] == [
        ("kl.0", 1.0, 1.0),
        ("kl.1", 0.5, 2.0),
    ]


def test_the_docs_third_party_distillation_loss_registers_and_trains(stored):
    """docs/distillation.md's RelationalKD plugin, registered through the plugin manager beside the
    built-ins, listed in train.distill.losses and run in a step."""
    import re
    import types
    from pathlib import Path

    from clipkit.contract.manager import make_plugin_manager
    from clipkit.contract.registry import Registry
    from clipkit.contract.testing import check_distill_loss

    text = (Path(__file__).resolve().parents[1] / "docs" / "distillation.md").read_text(encoding="utf-8")
    source = next(
        b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "register_distill_losses" in b
    )
    plugin = types.ModuleType("relational_plugin")
    exec(compile(source, "docs/distillation.md", "exec"), plugin.__dict__)
    registry = Registry(make_plugin_manager(autoload=False, extra_plugins=[plugin]))
    assert registry.get("distill_loss", "relational").plugin != registry.get("distill_loss", "kl").plugin
    check_distill_loss(registry.factory("distill_loss", "relational")())
    out, _ = stored
    losses = "train.distill.losses=[{name: kl}, {name: relational, weight: 0.1}]"
    recipe = recipe_for(out, *RECIPE_AUGMENT, "train.distill.stored=true", losses)
    assert validate(recipe, registry) == []
    model = build_model(recipe, registry)
    objective = build_objective(recipe, registry, model)
    objective.distill = build_distillation(recipe, registry, objective.runtime, model.transform, str(out))
    transform = build_transform(recipe, train=True)
    stream = BatchStream(out, batch_size=16, transform=transform, tokenizer=model.tokenizer, seed=0,
                         shuffle_buffer=0, distill=DistillInputs(stored=True))  # fmt: skip
    _, result = TrainingStep(model, objective)(next(iter(stream)), 0, 0.0)
    assert result.metrics["distill/relational"] > 0 and result.metrics["distill/kl"] > 0


def test_damaged_stored_members_are_named():
    from clipkit.data.teacher_shards import encode_array, stored_view

    good = {IMAGE_MEMBER: encode_array(np.ones((2, 4))), TEXT_MEMBER: encode_array(np.ones((1, 4))),
            SEEDS_MEMBER: b'{"seeds": ["aug:0:0:7", "aug:0:1:7"]}'}  # fmt: skip
    view = stored_view(good, 3, "sample 7")
    assert view.seed == "aug:0:1:7" and view.image.tolist() == [1.0] * 4 and view.texts.shape == (1, 4)
    cases = {
        "has no teacher_text.npy": {k: v for k, v in good.items() if k != TEXT_MEMBER},
        "cannot be read as a .npy array": {**good, IMAGE_MEMBER: b"not numpy"},
        "expected a float32": {**good, IMAGE_MEMBER: encode_array(np.ones(4))},
        'is not {"seeds"': {**good, SEEDS_MEMBER: b"[1, 2]"},
        "1 seeds for 2 stored views": {**good, SEEDS_MEMBER: b'{"seeds": ["x"]}'},
    }
    for message, record in cases.items():
        with pytest.raises(DataError, match=re.escape(message)) as raised:
            stored_view(record, 0, "sample 7")
        assert str(raised.value).startswith("sample 7")
