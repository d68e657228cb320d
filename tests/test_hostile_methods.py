"""Method settings a researcher mistypes: every loss, similarity and optimiser argument outside its
range is one line naming its recipe key at ``clipkit validate`` (not after the data is sharded,
not a traceback, not a silent NaN or no-op run), and the edge values the papers use still pass.

Built in-process (recipes resolved and validated, plugins built from them): no training runs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from clipkit.config.recipe import load_recipe, validate
from clipkit.contract.types import Logits, PointSet
from clipkit.errors import BatchRefusedError, ClipkitError
from clipkit.model import build_model, build_slot
from clipkit.train.objective import Objective, build_objective

# (recipe, overrides, what validate says) — each was accepted by validate before, and refused only
# once train had sharded the data and built the slot (or never: the silent runs, marked).
REFUSED = [
    ("clip@tiny", ["loss.label_smoothing=1"], "loss.label_smoothing: must be >= 0 and < 1, got 1"),
    ("clip@tiny", ["similarity.init_scale=0"], "similarity.init_scale: must be > 0, got 0"),
    # train: `math domain error`
    ("clip@tiny", ["similarity.max_scale=0"], "similarity.max_scale: must be > 0, got 0"),
    ("siglip@tiny", ["similarity.max_scale=-5"], "similarity.max_scale: must be > 0, got -5"),
    # train: `IndexError: tuple index out of range`; a third beta was silently dropped
    ("clip@tiny", ["optimizer.betas=[0.9]"], "optimizer.betas: must be a list of 2 numbers"),
    ("clip@tiny", ["optimizer.betas=[0.9,0.98,0.99]"], "optimizer.betas: must be a list of 2 numbers"),
    ("clip@tiny", ["optimizer.betas=[0.9,abc]"], "optimizer.betas: must be a list of 2 numbers"),
    ("clip@tiny", ["optimizer.betas=[0.9,1.0]"], "optimizer.betas: each must be >= 0 and < 1"),
    ("clip@tiny", ["optimizer.betas=[-0.1,0.98]"], "optimizer.betas: each must be >= 0 and < 1"),
    ("wpse@tiny", ["similarity.num_features=0"], "similarity.num_features: must be > 0, got 0"),
    ("wpse@tiny", ["similarity.num_features=-5"], "similarity.num_features: must be > 0, got -5"),
    ("wpse@tiny", ["similarity.sigma=0"], "similarity.sigma: must be > 0, got 0"),
    ("wpse@tiny", ["similarity.kernel=imq", "similarity.c=-1"], "similarity.c: must be > 0, got -1"),
    ("wpse@tiny", ["similarity.kernel=laplace"], "similarity.kernel: must be one of gaussian, imq"),
    ("wpse@tiny", ["similarity.alpha=[0,0]"], "similarity.alpha: must not be all zero"),
    ("wpse@tiny", ["similarity.alpha=[-1,2]"], "similarity.alpha: each must be >= 0"),
    ("wpse@tiny", ["similarity.alpha=[0.5]"], "similarity.alpha: must be a list of 2 numbers"),
    ("wpse@tiny", ["similarity.alpha=[0.5,abc]"], "similarity.alpha: must be a list of 2 numbers"),
    ("kme_clip@tiny", ["similarity.init_gamma=0"], "similarity.init_gamma: must be > 0, got 0"),
    ("kme_clip@tiny", ["similarity.max_gamma=-1"], "similarity.max_gamma: must be > 0, got -1"),
    ("kme_clip@tiny", ["similarity.block_size=0"], "similarity.block_size: must be > 0, got 0"),
    ("kme_clip@tiny", ["similarity.implementation=cuda"], "similarity.implementation: must be one of"),
    ("kme_clip@tiny", ["similarity.matmul_dtype=float8"], "similarity.matmul_dtype: must be one of"),
    # silent: every retrieved embedding the batch mean, the loss constant, no gradient
    ("cloob@tiny", ["similarity.beta=0"], "similarity.beta: must be > 0, got 0"),
    ("cloob@tiny", ["similarity.inverse_tau=-30"], "similarity.inverse_tau: must be > 0, got -30"),
    ("cloob@tiny", ["loss.inverse_tau=0"], "loss.inverse_tau: must be > 0, got 0"),
    ("nuclr@tiny", ["loss.tau=0"], "loss.tau: must be > 0, got 0"),
    ("nuclr@tiny", ["loss.gamma=0"], "loss.gamma: must be > 0 and <= 1, got 0"),
    ("nuclr@tiny", ["loss.gamma=1.5"], "loss.gamma: must be > 0 and <= 1, got 1.5"),
    ("nuclr@tiny", ["loss.zeta_lr=-1"], "loss.zeta_lr: must be >= 0, got -1"),
    ("nuclr@tiny", ["loss.zeta_momentum=0"], "loss.zeta_momentum: must be > 0 and <= 1, got 0"),
    ("nuclr@tiny", ["loss.zeta_lr_image_scale=-1"], "loss.zeta_lr_image_scale: must be >= 0"),
    ("nuclr@tiny", ["loss.freeze_epochs=-1"], "loss.freeze_epochs: must be >= 0, got -1"),
    # silent: only a warning that ζ will not move
    ("nuclr@tiny", ["loss.epochs=0"], "loss.epochs: must be >= 1, got 0"),
    ("nuclr@tiny", ["loss.epochs=-3"], "loss.epochs: must be >= 1, got -3"),
    ("nuclr@tiny", ["loss.first_visit=foo"], "loss.first_visit: must be one of ema, set"),
    ("nuclr@tiny", ["loss.zeta_lr_schedule=linear"], "loss.zeta_lr_schedule: must be one of"),
    ("nuclr@tiny", ["loss={name: sogclr, gamma: 1.5}"], "loss.gamma: must be > 0 and <= 1, got 1.5"),
    ("nuclr@tiny", ["loss={name: sogclr, tau: -1}"], "loss.tau: must be > 0, got -1"),
    ("clip@tiny", ["loss={name: cyclip, lambda_cross: -1}"], "loss.lambda_cross: must be >= 0, got -1"),
    ("clip@tiny", ["loss={name: dcl, weighting_sigma: 0}"], "loss.weighting_sigma: must be > 0, got 0"),
    ("clip@tiny", ["loss={name: debiased, tau_plus: 1}"], "loss.tau_plus: must be >= 0 and < 1, got 1"),
    ("clip@tiny", ["loss={name: debiased, temperature: 0}"], "loss.temperature: must be > 0, got 0"),
    ("yaware@tiny", ["loss={name: supcon, temperature: 0}"], "loss.temperature: must be > 0, got 0"),
    ("yaware@tiny", ["loss={name: supcon, base_temperature: -1}"], "loss.base_temperature: must be > 0"),
    ("yaware@tiny", ["loss.lam=-1"], "loss.lam: must be >= 0, got -1"),
    ("yaware@tiny", ["loss.eps=0"], "loss.eps: must be > 0, got 0"),
    (
        "yaware@tiny",
        ["loss.kernel=[{key: label, type: rbf, sigma: 0}]"],
        "loss.kernel: an rbf kernel factor needs 'sigma' > 0",
    ),
    ("yaware@tiny", ["loss.kernel=[{key: label, type: gauss}]"], "loss.kernel: unknown kernel type 'gauss'"),
    ("yaware@tiny", ["loss.kernel=[]"], "loss.kernel: kernel must be a non-empty list of factors"),
    (
        "yaware@tiny",
        ["loss={name: yaware_infonce, normalisation: cols}"],
        "loss.normalisation: must be one of",
    ),
    ("yaware@tiny", ["loss={name: align_uniform, alpha: 0}"], "loss.alpha: must be > 0, got 0"),
    ("yaware@tiny", ["loss={name: align_uniform, t: -1}"], "loss.t: must be > 0, got -1"),
]


def errors_for(registry, spec: str, overrides: list[str]) -> list[str]:
    return validate(load_recipe(spec, overrides, registry=registry), registry)


@pytest.mark.parametrize(("spec", "overrides", "message"), REFUSED, ids=[" ".join(r[1]) for r in REFUSED])
def test_validate_refuses_a_bad_method_setting_naming_its_key_and_range(registry, spec, overrides, message):
    errors = errors_for(registry, spec, overrides)
    assert any(message in error for error in errors), errors
    assert len(errors) == 1, errors  # one line, not a type error and a range error too


# Edge values the papers and their code use, or that are meaningful limits: validated and built.
ACCEPTED = [
    ("nuclr@tiny", ["loss.gamma=1"]),  # u is the batch's own g (no moving average)
    ("nuclr@tiny", ["loss.zeta_lr=0", "loss.zeta_lr_schedule=constant"]),  # ζ frozen: SogCLR + ξ
    ("nuclr@tiny", ["loss.epochs=2", "loss.freeze_epochs=0"]),
    ("nuclr@tiny", ["loss={name: sogclr, gamma: 1}"]),
    ("wpse@tiny", ["similarity.alpha=[1,0]"]),  # linear kernel only
    ("wpse@tiny", ["similarity.alpha=[0,1]"]),  # Gaussian only
    ("wpse@tiny", ["similarity.num_features=1"]),
    ("wpse@tiny", ["similarity.kernel=imq", "similarity.c=0.5"]),
    ("cloob@tiny", ["similarity.beta=14.3"]),  # YFCC, the official code's default
    ("clip@tiny", ["loss={name: cyclip, lambda_cross: 0, lambda_in: 0}"]),  # CLIP
    ("clip@tiny", ["loss={name: debiased, tau_plus: 0}"]),  # InfoNCE
    ("clip@tiny", ["similarity.max_scale=null"]),
    ("siglip@tiny", ["similarity.bias=0"]),
    ("yaware@tiny", ["loss.kernel=same_sample"]),  # SimCLR
    ("yaware@tiny", ["loss={name: align_uniform, align_weight: 0}"]),  # uniformity alone
    ("clip@tiny", ["optimizer.betas=[0.0,0.999]"]),
]


@pytest.mark.parametrize(("spec", "overrides"), ACCEPTED, ids=[" ".join(a[1]) for a in ACCEPTED])
def test_edge_values_the_papers_use_are_validated_and_built(registry, spec, overrides):
    recipe = load_recipe(spec, overrides, registry=registry)
    assert validate(recipe, registry) == []
    model = build_model(recipe, registry)
    build_objective(recipe, registry, model, num_samples=64)
    build_slot(registry, "optimizer", recipe["optimizer"], "optimizer", list(model.named_parameters()))


# What a constraint cannot say (one argument against another), or the Python API without a recipe:
# the factory refuses it, which `train` names with the slot before any data is read.
FACTORY_REFUSALS = [
    ("similarity", {"name": "dot", "max_scale": 0.0}, "max_scale must be > 0"),  # was: math domain error
    ("similarity", {"name": "cosine_mean", "max_scale": -1.0}, "max_scale must be > 0"),
    ("similarity", {"name": "wpse", "alpha": [0.5, "abc"]}, "alpha must be [alpha1, alpha2], two numbers"),
    ("similarity", {"name": "hopfield", "beta": 0.0}, "beta (Hopfield inverse temperature) must be > 0"),
    ("loss", {"name": "align_uniform", "align_weight": 0, "uniform_weight": 0}, "both 0"),
    ("loss", {"name": "nuclr", "epochs": 0, "num_samples": 64}, "epochs must be >= 1"),
]


@pytest.mark.parametrize(
    ("kind", "config", "message"), FACTORY_REFUSALS, ids=[str(r[1]) for r in FACTORY_REFUSALS]
)
def test_the_factory_refuses_what_validate_cannot_see_in_one_line(registry, kind, config, message):
    with pytest.raises(ClipkitError, match=r"^" + kind) as refused:
        build_slot(registry, kind, config, kind, embed_dim=8)
    assert message in str(refused.value) and "\n" not in str(refused.value)


# ----------------------------------------------------------------------------- refusals at step time


def test_a_loss_refusing_the_batch_is_one_line_naming_the_loss_and_the_fix(registry):
    """SupCon (or a y-Aware kernel) on data without the meta-data it reads was a 60-line traceback."""
    from clipkit.contract.testing import synthetic_batch

    recipe = load_recipe("quickstart@smoke", ["loss={name: supcon}"], registry=registry)
    model = build_model(recipe, registry)
    objective = build_objective(recipe, registry, model)
    batch = synthetic_batch(model, 4, recipe["model"]["image_size"])
    batch["meta"] = {"colour": ["red", "blue", "red", "green"]}
    a, b = model(batch)
    with pytest.raises(BatchRefusedError) as refused:
        objective(a, b, batch, step=0, epoch=0.0)
    message = str(refused.value)
    assert message.startswith("the loss ") and "SupConLoss refused the batch" in message
    assert "meta-data key 'label'" in message and "data.meta_keys.label=COLUMN" in message


def test_an_rbf_kernel_on_categories_says_so_and_names_the_delta_kernel():
    from clipkit.plugins.losses.yaware import rbf_values

    with pytest.raises(ValueError, match=r"meta\['colour'\] needs numbers.*\{key: colour, type: delta\}"):
        rbf_values(["red", "blue"], "colour")


class RefusingSimilarity(nn.Module):
    """A similarity whose forward refuses every batch (its module is this test file)."""

    def forward(self, a: PointSet, b: PointSet, *, generator=None) -> Logits:
        raise ValueError("points of the wrong kind")


def test_a_similarity_refusing_the_batch_is_named_as_the_similarity():
    from clipkit.plugins.losses.infonce import InfoNCE
    from clipkit.train.runtime import Runtime

    objective = Objective(
        InfoNCE(), RefusingSimilarity(), Runtime(precision="no", seed=0, global_batch_size=2)
    )
    points = PointSet(torch.nn.functional.normalize(torch.randn(2, 1, 4), dim=-1))
    with pytest.raises(
        BatchRefusedError, match=r"^the similarity .*RefusingSimilarity refused the batch: points"
    ):
        objective(points, points, {"meta": {}}, step=0, epoch=0.0)


# ----------------------------------------------------------------------------- one τ, two slots

# NUCLR/SogCLR read the logits as e/τ with their own τ (Σ = τ·L), CLOOB multiplies by its own τ: an
# override of one slot's temperature trained another objective without a word.
SHARED_TAU_REFUSED = [
    ("nuclr@tiny", ["similarity.init_scale=50"], "loss.tau=0.01 needs logits scaled by 1/τ = 100"),
    ("nuclr@tiny", ["loss.tau=0.02"], "the similarity (DotSimilarity) scales them by 100"),
    ("nuclr@tiny", ["loss={name: sogclr, tau: 0.02}"], "loss.tau=0.02 needs logits scaled by 1/τ = 50"),
    ("nuclr@tiny", ["similarity.learn_scale=true"], "needs a fixed logit scale 1/τ, but the similarity"),
    ("nuclr@tiny", ["similarity.bias=0"], "learns bias"),
    ("cloob@tiny", ["loss.inverse_tau=10"], "loss.inverse_tau=10 needs logits scaled by 1/τ = 10"),
    ("cloob@tiny", ["similarity.inverse_tau=10"], "(HopfieldSimilarity) scales them by 10"),
]


@pytest.mark.parametrize(
    ("spec", "overrides", "message"), SHARED_TAU_REFUSED, ids=[" ".join(r[1]) for r in SHARED_TAU_REFUSED]
)
def test_a_temperature_the_loss_and_similarity_share_is_refused_when_they_differ(
    registry, spec, overrides, message
):
    recipe = load_recipe(spec, overrides, registry=registry)
    model = build_model(recipe, registry)
    with pytest.raises(ClipkitError, match=r"^loss: ") as refused:
        build_objective(recipe, registry, model, num_samples=64)
    assert message in str(refused.value)


@pytest.mark.parametrize(
    ("spec", "overrides"),
    [
        ("nuclr@tiny", ["loss.tau=0.02", "similarity.init_scale=50"]),
        ("cloob@tiny", ["loss.inverse_tau=14.3", "similarity.inverse_tau=14.3"]),  # the official code's
        ("cloob@tiny", ["similarity.learn_scale=true"]),  # starts at the loss's 1/τ (METHODS §4 allows it)
        ("cloob@tiny", ["loss={name: infonce}"]),  # the infonce_hopfield ablation: no τ of its own
    ],
)
def test_a_shared_temperature_set_in_both_slots_is_accepted(registry, spec, overrides):
    recipe = load_recipe(spec, overrides, registry=registry)
    assert validate(recipe, registry) == []
    build_objective(recipe, registry, build_model(recipe, registry), num_samples=64)
