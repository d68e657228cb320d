"""``model.init`` (start from converted weights, strictly) and ``model.frozen`` (locked towers whose
weights stay bit-identical, and whose outputs are computed once per sample)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from clipkit.app.cli import make_app
from clipkit.artifacts.export import write_export
from clipkit.config.recipe import load_recipe, validate_or_raise
from clipkit.contract.manager import make_plugin_manager
from clipkit.contract.types import PointSet
from clipkit.errors import ClipkitError
from clipkit.model import build_model
from clipkit.model.init_weights import FrozenOutputCache, init_from
from clipkit.plugins.interop.layouts import load_model
from clipkit.train.checkpoint import latest_checkpoint, load_checkpoint
from clipkit.train.loop import build_trainer

runner = CliRunner()
TOKENIZER = ["model.tokenizer.name=clip_bpe", "model.tokenizer.context_length=16"]


def small_data(tmp_path) -> list[str]:
    return [
        "data.source=synthetic://shapes?n=64&split=train&image_size=48",
        f"data.shards={tmp_path / 'shards'}",
        "data.batch_size=16",
        "train.export=false",
        "train.log_every=1",
        "optimizer.lr=0.01",
        "schedule.warmup_steps=0",
    ]


def export_of(tmp_path, registry, overrides=(), name="source", seed=0):
    recipe = validate_or_raise(
        load_recipe("clip@tiny", [*TOKENIZER, *overrides], registry=registry), registry
    )
    torch.manual_seed(seed)
    model = build_model(recipe, registry)
    with torch.no_grad():  # not the recipe's own init: a run that ignored model.init would show
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    return write_export(model, recipe, tmp_path / name, registry)


def train(tmp_path, overrides, run="run"):
    app = make_app(make_plugin_manager(autoload=False))
    args = [
        "train",
        "clip@tiny",
        *TOKENIZER,
        *small_data(tmp_path),
        *overrides,
        "--run-dir",
        str(tmp_path / run),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return tmp_path / run


def clip_loss(model, batch) -> torch.Tensor:
    """CLIP's symmetric InfoNCE of ``model`` on ``batch``, computed here from scratch."""
    logits = model.similarity(model.encode_image(batch["image"]), model.encode_text(batch["text"])).i2t
    labels = torch.arange(len(logits))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


@pytest.mark.slow
def test_first_step_loss_is_the_converted_models_loss(tmp_path, registry):
    """`clipkit train clip@tiny model.init=<converted Hugging Face model>`: step 1's loss is the
    converted model's loss on that batch."""
    from interop_support import import_transformers
    from test_interop_hf import save_hf

    transformers = import_transformers()
    text = {"hidden_size": 64, "intermediate_size": 256, "num_attention_heads": 2, "num_hidden_layers": 2,
            "max_position_embeddings": 16, "hidden_act": "gelu"}  # fmt: skip
    vision = {"hidden_size": 64, "intermediate_size": 256, "num_attention_heads": 2, "num_hidden_layers": 2,
              "image_size": 48, "patch_size": 8, "hidden_act": "gelu"}  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.CLIPModel(
        transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=64)
    )
    source = save_hf(hf, tmp_path / "hf")
    converted = runner.invoke(make_app(make_plugin_manager(autoload=False)),
                              ["convert", str(source), str(tmp_path / "converted")])  # fmt: skip
    assert converted.exit_code == 0, converted.output
    # The converted model keeps its own preprocessing; the run uses the same normalisation.
    mean = json.loads((tmp_path / "converted" / "clipkit.json").read_text())["preprocessing"]
    norm = [f"model.mean={mean['mean']}", f"model.std={mean['std']}"]
    run = train(tmp_path, [f"model.init={tmp_path / 'converted'}", "train.steps=1", *norm])
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1

    recipe = validate_or_raise(
        load_recipe("clip@tiny", [*TOKENIZER, *small_data(tmp_path), *norm], registry=registry), registry
    )
    batch = next(iter(build_trainer(recipe, tmp_path / "fresh", registry).stream))  # the same first batch
    model, _ = load_model(tmp_path / "converted", registry)
    with torch.no_grad():
        expected = clip_loss(model, batch)
    assert first["loss"] == pytest.approx(float(expected), rel=1e-5)
    random_start = build_model(recipe, registry)
    with torch.no_grad():
        assert abs(float(clip_loss(random_start, batch)) - first["loss"]) > 1e-3  # the init mattered


@pytest.mark.slow
@pytest.mark.parametrize(
    ("locked", "trained"), [("image_encoder", "text_encoder"), ("text_encoder", "image_encoder")]
)
def test_locked_tower_is_bit_identical_after_training(locked, trained, tmp_path, registry):
    source = export_of(tmp_path, registry)
    run = train(tmp_path, [f"model.init={source}", f"model.frozen=[{locked}]", "train.steps=3"])
    after = load_checkpoint(latest_checkpoint(run))["model"]
    before, _ = load_model(source, registry)
    before = before.state_dict()
    for key, value in before.items():
        if key.startswith(locked):
            assert torch.equal(after[key], value), key
    changed = [k for k in before if k.startswith(trained) and not torch.equal(after[k], before[k])]
    assert changed  # the other tower did train


def test_init_is_strict_and_names_the_keys(tmp_path, registry):
    """A source with an extra weight head: the error lists the unexpected keys; exclude fixes it."""
    source = export_of(
        tmp_path, registry, ["model.image_encoder.output=tokens", "model.image_encoder.weights=softplus"]
    )
    recipe = validate_or_raise(load_recipe("clip@tiny", TOKENIZER, registry=registry), registry)
    model = build_model(recipe, registry)
    with pytest.raises(ClipkitError, match=r"not in the model: \['image_encoder.weight_head.linear.bias'"):
        init_from(model, str(source), registry)
    copied = init_from(model, {"path": str(source), "exclude": ["image_encoder.weight_head.*"]}, registry)
    reference, _ = load_model(source, registry)
    assert len(copied) == len(model.state_dict())
    assert all(torch.equal(model.state_dict()[k], reference.state_dict()[k]) for k in copied)


def test_init_with_filters_loads_one_tower(tmp_path, registry):
    """include: only the image tower comes from a source whose text side does not fit (its tokenizer
    has another vocabulary); without the filter the shapes are refused."""
    source = export_of(
        tmp_path, registry, ["model.tokenizer.name=hashed_words", "model.tokenizer.vocab_size=512"]
    )
    recipe = validate_or_raise(load_recipe("clip@tiny", TOKENIZER, registry=registry), registry)
    model = build_model(recipe, registry)
    untouched = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("text_encoder")}
    with pytest.raises(
        ClipkitError, match="text_encoder.token_embedding.weight: \\(512, 64\\) vs \\(49408, 64\\)"
    ):
        init_from(model, str(source), registry)
    init_from(model, {"path": str(source), "include": ["image_encoder.*"]}, registry)
    reference, _ = load_model(source, registry)
    assert all(
        torch.equal(v, reference.state_dict()[k]) for k, v in model.state_dict().items() if "image" in k
    )
    assert all(torch.equal(model.state_dict()[k], v) for k, v in untouched.items())


def test_init_refuses_another_activation(tmp_path, registry):
    vit = ["name=vit", "patch_size=8", "width=64", "layers=2", "heads=2", "quick_gelu=true"]
    source = export_of(tmp_path, registry, [f"model.image_encoder.{item}" for item in vit])
    recipe = validate_or_raise(load_recipe("clip@tiny", TOKENIZER, registry=registry), registry)
    with pytest.raises(ClipkitError, match="set model.image_encoder.quick_gelu=true"):
        init_from(build_model(recipe, registry), str(source), registry)


def test_unknown_frozen_tower_is_an_error(tmp_path):
    app = make_app(make_plugin_manager(autoload=False))
    args = ["train", "clip@tiny", *small_data(tmp_path), "model.frozen=[vision]", "train.steps=1"]
    result = runner.invoke(app, [*args, "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 2 and "model.frozen: 'vision' is not a tower" in result.output


class Counting(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.rows = 0

    def forward(self, x):
        self.rows += len(x)
        return PointSet(F.normalize(self.linear(x.float()), dim=-1).unsqueeze(1))


def test_frozen_output_cache_computes_each_sample_once():
    module = Counting().requires_grad_(False)
    reference = [module(x).points for x in (torch.arange(8.0).view(2, 4), torch.ones(3, 4))]
    module.rows = 0
    cache = FrozenOutputCache.attach(module)
    first = module(torch.arange(8.0).view(2, 4))
    again = module(torch.cat([torch.arange(8.0).view(2, 4), torch.ones(3, 4)]))  # 2 seen, 3 new
    assert module.rows == 2 + 3 and cache.computed == 5
    torch.testing.assert_close(first.points, reference[0])
    torch.testing.assert_close(again.points, torch.cat(reference))
    assert module(torch.ones(3, 4)).points.shape == (3, 1, 3) and module.rows == 5
    assert module.state_dict().keys() == {"linear.weight", "linear.bias"}


@pytest.mark.slow
def test_resume_does_not_reapply_init(tmp_path, registry):
    """A resumed run continues from its checkpoint, even when the init source is gone."""
    import shutil

    source = export_of(tmp_path, registry)
    overrides = [f"model.init={source}", "train.checkpoint_every=1"]
    run = train(tmp_path, [*overrides, "train.steps=2"])
    shutil.rmtree(source)
    app = make_app(make_plugin_manager(autoload=False))
    args = ["train", "clip@tiny", "train.steps=3", "--run-dir", str(run), "--resume"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert latest_checkpoint(run).name == "step-00000003"
