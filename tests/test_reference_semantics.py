"""open_clip's training semantics, step by step (issue 38): the learnable logit scale is clamped
after the optimiser step (its gradient flows at the bound, so it can come back down), and the lr
logged for a step is the lr that step used.

clipkit's real loop (``train_loop`` over ``clip@tiny``, in fp64, fed in-memory batches) is compared
with a plain re-implementation of open_clip's ``train_one_epoch`` on a copy of the same weights
and the same batches: the towers' features, ``ClipLoss`` (logit_scale.exp() · image @ textᵀ, the
mean of the two cross-entropies), AdamW over open_clip's parameter groups, ``cosine_lr`` assigned
before each step, and ``logit_scale.clamp_(0, ln 100)`` after ``optimizer.step()``.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from smoke_data import place_smoke_shards
from torch import nn

from clipkit.app.api import resolve
from clipkit.contract.hookspecs import hookimpl
from clipkit.contract.manager import make_plugin_manager
from clipkit.contract.registry import Registry
from clipkit.data.memory import InMemoryStream
from clipkit.train.build import build_trainer, prepare_run_dir
from clipkit.train.loop import train_loop

STREAM = "reference_semantics_batches"
STEPS, BATCH, LR, WARMUP = 8, 8, 2e-3, 3
BETAS, EPS, WEIGHT_DECAY = (0.9, 0.98), 1e-6, 0.2


def make_batch(seed: int, image_size: int, context: int, vocab: int) -> dict:
    """Random fp64 images and token rows (ids > 0, then zero padding) of BATCH samples."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(BATCH, 3, image_size, image_size, generator=generator, dtype=torch.float64)
    lengths = torch.randint(2, context + 1, (BATCH, 1), generator=generator)
    ids = torch.randint(1, vocab, (BATCH, context), generator=generator)
    text = torch.where(torch.arange(context).expand(BATCH, context) < lengths, ids, 0)
    return {"image": images, "text": text, "index": torch.arange(BATCH)}


def clipkit_run(tmp_path, *overrides: str):
    """clip@tiny's trainer in fp64 at the logit scale's bound (100), fed in-memory batches."""
    batches: list[dict] = []

    class Streams:
        @hookimpl
        def register_streams(self, register):
            register(STREAM, lambda batch_size, seed, rank, world_size: InMemoryStream(batches))

    registry = Registry(make_plugin_manager(extra_plugins=[Streams()]))
    recipe = resolve(
        "clip@tiny",
        [
            f"data.stream={{name: {STREAM}}}",
            f"data.batch_size={BATCH}",
            f"train.steps={STEPS}",
            "train.log_every=1",
            "train.export=false",
            "train.threads=1",
            "similarity.init_scale=100.0",
            f"optimizer.lr={LR}",
            f"optimizer.weight_decay={WEIGHT_DECAY}",
            f"schedule.warmup_steps={WARMUP}",
            *overrides,
        ],
        registry,
    )
    run_dir = tmp_path / "run"
    prepare_run_dir(recipe, run_dir, resume=False)
    trainer = build_trainer(recipe, run_dir, registry)
    trainer.model.double()  # fp64 throughout: the comparison is exact to rounding
    trainer.objective.feature_dtype = torch.float64
    with torch.no_grad():  # ln 100 in fp64 (the fp32 value converted to fp64 lies 6e-8 above it)
        trainer.model.similarity.log_scale.fill_(math.log(100.0))
    tokenizer = trainer.model.tokenizer
    image_size = int(recipe["model"]["image_size"])
    batches += [
        make_batch(seed, image_size, tokenizer.context_length, tokenizer.vocab_size) for seed in (1, 2)
    ]
    return trainer, batches, run_dir


def open_clip_exclude(name: str, parameter: nn.Parameter) -> bool:
    """open_clip's main.py: no weight decay for gains, biases and the logit scale."""
    return parameter.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name


def open_clip_lr(step: int, total: int) -> float:
    """open_clip's ``cosine_lr`` (warm-up ``base_lr * (step + 1) / warmup_length``)."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    e, es = step - WARMUP, total - WARMUP
    return 0.5 * (1 + math.cos(math.pi * e / es)) * LR


def open_clip_loop(model, batches, *, clamp_in_forward: bool = False) -> dict:
    """open_clip's ``train_one_epoch`` on ``model``'s towers (its similarity's scale replaced by
    open_clip's own ``logit_scale`` parameter); ``clamp_in_forward`` instead clamps the value in the
    forward pass and never the parameter (clipkit's old semantics, to show the test can fail)."""
    logit_scale = nn.Parameter(torch.tensor(math.log(100.0), dtype=torch.float64))
    named = [(n, p) for n, p in model.named_parameters() if not n.startswith("similarity.")]
    named.append(("logit_scale", logit_scale))
    exclude = [p for n, p in named if open_clip_exclude(n, p)]
    include = [p for n, p in named if not open_clip_exclude(n, p)]
    groups = [{"params": exclude, "weight_decay": 0.0}, {"params": include, "weight_decay": WEIGHT_DECAY}]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
    losses, lrs, scales = [], [], []
    for step in range(STEPS):
        lr = open_clip_lr(step, STEPS)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = batches[step % len(batches)]
        optimizer.zero_grad()
        image_points, text_points = model({"image": batch["image"], "text": batch["text"]})
        image, text = image_points.points[:, 0], text_points.points[:, 0]  # unit features
        scale = logit_scale.exp()
        if clamp_in_forward:
            scale = scale.clamp(max=100.0)
        logits_per_image = scale * image @ text.T
        logits_per_text = scale * text @ image.T
        labels = torch.arange(len(image))
        loss = (
            nn.functional.cross_entropy(logits_per_image, labels)
            + nn.functional.cross_entropy(logits_per_text, labels)
        ) / 2
        loss.backward()
        optimizer.step()
        if not clamp_in_forward:
            with torch.no_grad():
                logit_scale.clamp_(0, math.log(100))
        losses.append(float(loss.detach()))
        lrs.append(lr)
        scales.append(float(logit_scale))
    return {"loss": losses, "lr": lrs, "log_scale": scales, "model": model}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    trainer, batches, run_dir = clipkit_run(tmp_path_factory.mktemp("parity"))
    reference_model = copy.deepcopy(trainer.model)
    stuck_model = copy.deepcopy(trainer.model)
    train_loop(trainer)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "loss" in row]
    return {
        "clipkit": {"rows": rows, "model": trainer.model},
        "open_clip": open_clip_loop(reference_model, batches),
        "forward_clamp": open_clip_loop(stuck_model, batches, clamp_in_forward=True),
    }


def test_clipkit_trains_step_by_step_as_open_clip_from_a_scale_at_the_clamp(runs):
    ours, theirs = runs["clipkit"], runs["open_clip"]
    assert [row["step"] for row in ours["rows"]] == list(range(1, STEPS + 1))
    for mine, reference in zip([row["loss"] for row in ours["rows"]], theirs["loss"], strict=True):
        assert mine == pytest.approx(reference, rel=1e-12, abs=1e-12)
    # The scale left its bound (the gradient flows there) and both runs kept it identically.
    assert min(theirs["log_scale"]) < math.log(100.0) - 1e-3
    mine_scales = [math.log(row["logit_scale"]) for row in ours["rows"]]
    assert mine_scales == pytest.approx(theirs["log_scale"], rel=1e-12, abs=1e-12)
    # The weights after 8 AdamW steps, to 1e-11: the attention's key bias (a third of in_proj.bias)
    # has a true gradient of 0 (softmax ignores a per-row constant), so both runs step it by rounding
    # noise normalised by Adam (|Δ| up to ~4e-12 over the steps); every other weight agrees to ~1e-13.
    weights = dict(theirs["model"].named_parameters())
    for name, parameter in ours["model"].named_parameters():
        if name.startswith("similarity."):
            continue
        torch.testing.assert_close(parameter, weights[name], rtol=1e-12, atol=1e-11, msg=name)


def test_a_scale_clamped_in_the_forward_pass_cannot_come_back_down(runs):
    """The old semantics (the value clamped in the forward pass) differ: the comparison above can fail."""
    stuck, theirs = runs["forward_clamp"], runs["open_clip"]
    assert max(abs(a - b) for a, b in zip(stuck["loss"], theirs["loss"], strict=True)) > 1e-6
    assert min(stuck["log_scale"]) > math.log(100.0) - 1e-12  # never below its start


def test_the_logged_lr_is_the_lr_the_step_used(runs):
    logged = [row["lr"] for row in runs["clipkit"]["rows"]]
    assert logged == pytest.approx(runs["open_clip"]["lr"], rel=1e-15)
    # Hand-derived: warm-up (step + 1) / warmup_steps of the base lr, then the cosine.
    assert logged[:WARMUP] == pytest.approx([LR / 3, 2 * LR / 3, LR], rel=1e-15)
    assert logged[WARMUP + 1] == pytest.approx(0.5 * (1 + math.cos(math.pi / 5)) * LR, rel=1e-15)


# ----------------------------------------------------------------------------- declared bounds


def test_bounded_parameters_are_collected_from_every_module():
    from clipkit.plugins.similarities.dot import DotSimilarity
    from clipkit.plugins.similarities.hopfield import HopfieldSimilarity
    from clipkit.plugins.similarities.kme import KMESimilarity
    from clipkit.plugins.similarities.wpse import WPSESimilarity
    from clipkit.train.bounds import bounded_parameters

    def names(similarity) -> list[str]:
        return [bound.name for bound in bounded_parameters(similarity=similarity, loss=object())]

    assert names(DotSimilarity()) == ["similarity.log_scale"]
    assert names(KMESimilarity()) == ["similarity.log_gamma"]
    assert names(HopfieldSimilarity(learn_scale=True)) == ["similarity.log_inverse_tau"]
    assert names(HopfieldSimilarity()) == []  # a fixed 1/τ
    assert names(WPSESimilarity(embed_dim=8)) == ["similarity.logit_scale.log_scale"]  # nested dot
    assert names(DotSimilarity(max_scale=None)) == names(DotSimilarity(learn_scale=False)) == []
    frozen = DotSimilarity()
    frozen.requires_grad_(False)
    assert names(frozen) == []


def test_a_declaration_naming_no_parameter_is_refused():
    from clipkit.errors import ClipkitError
    from clipkit.train.bounds import bounded_parameters

    class Wrong(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.t = nn.Parameter(torch.zeros(1))

        def parameter_bounds(self):
            return {"missing": (None, 1.0)}

    with pytest.raises(ClipkitError, match="names 'missing', not a parameter"):
        bounded_parameters(similarity=Wrong())

    class Empty(Wrong):
        def parameter_bounds(self):
            return {"t": (2.0, 1.0)}

    with pytest.raises(ClipkitError, match="empty interval"):
        bounded_parameters(similarity=Empty())


def test_the_loop_clamps_a_parameter_beyond_its_bound_after_the_step(tmp_path, monkeypatch, smoke_shards):
    """A scale above its bound (as an older checkpoint may hold) gets no gradient and no AdamW
    update (its state is zero, no decay on scalars); the clamp after the step puts it at ln 100."""
    from clipkit.config.recipe import load_recipe, validate_or_raise
    from clipkit.contract.registry import default_registry
    from clipkit.train.loop import train_step

    monkeypatch.chdir(tmp_path)
    place_smoke_shards(tmp_path, smoke_shards)
    registry = default_registry()
    recipe = validate_or_raise(
        load_recipe("quickstart@smoke", ["train.steps=2"], registry=registry), registry
    )
    (tmp_path / "run").mkdir()
    trainer = build_trainer(recipe, tmp_path / "run", registry)
    scale = trainer.model.similarity.log_scale
    assert [bound.name for bound in trainer.objective.bounds] == ["similarity.log_scale"]
    with torch.no_grad():
        scale.fill_(math.log(150.0))
    outcome = train_step(trainer, trainer.runtime.to_device(next(iter(trainer.stream))), 0)
    assert outcome.applied
    assert scale.item() == torch.tensor(math.log(100.0)).item()  # ln 100 in the parameter's fp32
