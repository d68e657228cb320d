"""Linear probe (METHODS §8): the L-BFGS fit against scikit-learn, CLIP's parametric binary search,
seed 000's SGD protocol, frozen-feature extraction, and the `linear_probe` eval task end to end."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
import torch.nn.functional as F

from clipkit.app import api
from clipkit.artifacts.export import write_export
from clipkit.artifacts.reader import load_export
from clipkit.contract.types import PointSet
from clipkit.data.transforms import ImageTransform, decode_transformed
from clipkit.errors import ClipkitError, DataError
from clipkit.eval.evaluate import load_samples
from clipkit.model import ContrastiveModel, build_model, build_slot
from clipkit.plugins.evals.linear_probe import LinearProbe, projection_module_name
from clipkit.plugins.evals.linear_probe_fit import (
    Standardizer,
    fit_linear_sgd,
    fit_logistic_regression,
    image_features,
    linear_logits,
    logistic_objective,
    parametric_binary_search,
    select_l2,
    sgd_hyperparameters,
    stratified_split,
)

TRAIN = "synthetic://shapes?split=train&n=96&seed=0&image_size=32"
TEST = "synthetic://shapes?split=train&n=64&seed=1&image_size=32"
CONVERGED = {"tolerance": 1e-10, "tolerance_change": 0.0}  # run L-BFGS to machine precision


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These fits are tiny: intra-op threads are pure overhead (10x slower on a busy 2-core box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def clusters(n: int, dim: int, classes: int, spread: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n points around ``classes`` random centres (float64), labels cycling 0..classes-1."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=generator, dtype=torch.float64)
    labels = torch.arange(n) % classes
    return centres[labels] + spread * torch.randn(n, dim, generator=generator, dtype=torch.float64), labels


# ----------------------------------------------------------------------------------------------
# The L-BFGS fit is scikit-learn's LogisticRegression
# ----------------------------------------------------------------------------------------------


def test_objective_by_hand():
    # W = 0, b = 0: every sample costs log C; the penalty is (l2 / 2)·‖W‖².
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 0])
    zero_w, zero_b = torch.zeros(4, 3, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    assert logistic_objective(x, y, zero_w, zero_b, 2.0).item() == pytest.approx(5 * math.log(4))
    w = torch.zeros(4, 3, dtype=torch.float64)
    w[1, 0] = 3.0
    x1 = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)  # logits [0, 3, 0, 0], label 1
    expected = -(3 - math.log(3 + math.exp(3))) + 0.5 * 0.5 * 9
    assert logistic_objective(x1, torch.tensor([1]), w, zero_b, 0.5).item() == pytest.approx(expected)


@pytest.mark.parametrize("c", [0.1, 1.0, 10.0])
def test_fit_agrees_with_sklearn_multinomial(c):
    linear_model = pytest.importorskip("sklearn.linear_model")
    x, y = clusters(120, 6, 4, spread=1.5, seed=0)
    weight, bias = fit_logistic_regression(x, y, 1 / c, **CONVERGED)
    reference = linear_model.LogisticRegression(C=c, tol=1e-12, max_iter=10_000).fit(x.numpy(), y.numpy())
    ref_weight, ref_bias = torch.from_numpy(reference.coef_), torch.from_numpy(reference.intercept_)
    assert weight.dtype == torch.float64 and weight.shape == (4, 6) and bias.shape == (4,)
    # scipy stops at |gradient| ~ 1e-8, which bounds the agreement of the parameters.
    torch.testing.assert_close(weight, ref_weight, atol=2e-6 * c, rtol=0)
    torch.testing.assert_close(bias, ref_bias - ref_bias.mean(), atol=2e-6 * c, rtol=0)
    probabilities = torch.softmax(linear_logits(x, weight, bias), dim=1)
    torch.testing.assert_close(
        probabilities, torch.from_numpy(reference.predict_proba(x.numpy())), atol=1e-6, rtol=0
    )
    # Same objective, and ours is at least as low (sklearn's optimum, up to rounding).
    ours = logistic_objective(x, y, weight, bias, 1 / c).item()
    theirs = logistic_objective(x, y, ref_weight, ref_bias, 1 / c).item()
    assert ours <= theirs + 1e-9 * abs(theirs)


def test_two_classes_equal_sklearn_binary_with_double_c():
    linear_model = pytest.importorskip("sklearn.linear_model")
    x, y = clusters(80, 5, 2, spread=2.0, seed=1)
    weight, bias = fit_logistic_regression(x, y, l2=1.0, **CONVERGED)
    # Binary sklearn fits one vector w; our rows split it evenly, so sklearn's C is 2 / l2.
    reference = linear_model.LogisticRegression(C=2.0, tol=1e-12, max_iter=10_000).fit(x.numpy(), y.numpy())
    torch.testing.assert_close(weight[1] - weight[0], torch.from_numpy(reference.coef_[0]), atol=1e-5, rtol=0)
    intercept = torch.tensor(reference.intercept_[0], dtype=torch.float64)
    torch.testing.assert_close(bias[1] - bias[0], intercept, atol=1e-5, rtol=0)
    torch.testing.assert_close(weight[0], -weight[1], atol=1e-9, rtol=0)


def test_fit_rejects_bad_inputs():
    x, y = clusters(10, 3, 2, spread=1.0, seed=0)
    with pytest.raises(ClipkitError, match="l2 must be > 0"):
        fit_logistic_regression(x, y, 0.0)
    with pytest.raises(ClipkitError, match=r"labels must lie in \[0, 1\)"):
        fit_logistic_regression(x, y, 1.0, num_classes=1)
    with pytest.raises(ClipkitError, match="NaN"):
        fit_logistic_regression(x.clone().fill_(float("nan")), y, 1.0)


# ----------------------------------------------------------------------------------------------
# CLIP's parametric binary search
# ----------------------------------------------------------------------------------------------


def test_binary_search_finds_the_peak_of_a_unimodal_score_with_15_fits():
    calls = []

    def score(l2: float) -> float:
        calls.append(l2)
        return -abs(math.log10(l2) - 1.375)  # peak at grid point k = 11 (1.375 decades)

    best, evaluated = parametric_binary_search(score)
    assert best == pytest.approx(10**1.375)
    # By hand: start k = -48..48 step 16 -> best 16; ±8 -> 8; ±4 -> 12; ±2 -> 10 ties 12, the
    # larger λ wins -> 12; ±1 -> 11.
    expected_k = [-48, -32, -16, 0, 16, 32, 48, 8, 24, 4, 12, 10, 14, 11, 13]
    assert calls == pytest.approx([10 ** (k / 8) for k in expected_k])
    assert [l2 for l2, _ in evaluated] == sorted(calls)


def test_binary_search_edges_and_ties_prefer_strong_regularisation():
    best, evaluated = parametric_binary_search(lambda l2: 0.5)  # all tied: the largest λ
    assert best == pytest.approx(1e6)
    best, _ = parametric_binary_search(lambda l2: -l2)  # monotone: the smallest λ, at the edge
    assert best == pytest.approx(1e-6)
    assert min(l2 for l2, _ in evaluated) == pytest.approx(1e-6)


def test_search_picks_strong_regularisation_on_noise():
    # Labels independent of the features: the best predictor is the majority class, which the
    # strongest regularisation (W -> 0, bias = class frequencies) gives; weaker ones fit noise.
    # 60 fitting samples in 40 dimensions are separable, so weak L2 fits pure noise; 300
    # validation samples make a lucky noise fit beating the majority vote unlikely.
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(360, 40, generator=generator, dtype=torch.float64)
    y = (torch.rand(360, generator=generator) < 0.3).long()
    l2, val_top1, evaluated = select_l2((x[:60], y[:60]), (x[60:], y[60:]), 2, max_iter=100)
    assert l2 == pytest.approx(1e6)
    assert val_top1 == pytest.approx(float((y[60:] == 0).double().mean()))
    assert dict(evaluated)[1e-6] < val_top1 - 0.05  # the unregularised end overfits


def test_search_picks_weak_regularisation_when_strong_hides_the_signal():
    # x1 = s + y + ε, x2 = s + ε' with a shared nuisance s ~ N(0, 10²): only x1 − x2 separates the
    # classes. Strong L2 keeps W ∝ the class-mean difference (x1 alone: accuracy ~ 50 %); weak L2
    # finds w ∝ (1, −1) (accuracy ~ 100 %).
    generator = torch.Generator().manual_seed(0)
    y = torch.arange(150) % 2
    nuisance = 10 * torch.randn(150, generator=generator, dtype=torch.float64)
    noise = 0.1 * torch.randn(150, 2, generator=generator, dtype=torch.float64)
    x = torch.stack([nuisance + y, nuisance], dim=1) + noise
    l2, val_top1, evaluated = select_l2((x[:100], y[:100]), (x[100:], y[100:]), 2, max_iter=200)
    assert val_top1 == 1.0 and dict(evaluated)[1e6] <= 0.7
    assert l2 <= 1e3  # where it collapses depends on the draw (5.6 for seed 0, 237 for seed 1)
    assert all(score < val_top1 for other, score in evaluated if other > l2)  # largest λ of the best


# ----------------------------------------------------------------------------------------------
# Seed 000's SGD protocol, split, standardisation
# ----------------------------------------------------------------------------------------------


def test_sgd_hyperparameters_follow_seed_000():
    assert sgd_hyperparameters(9_999) == (0.05, 1024)
    assert sgd_hyperparameters(10_000) == (0.01, 4096)


def test_sgd_learns_a_separable_problem_deterministically():
    x, y = clusters(120, 8, 3, spread=0.3, seed=2)
    rng_before = torch.get_rng_state()
    weight, bias = fit_linear_sgd(x[:90], y[:90], epochs=20, batch_size=16, seed=3)
    assert torch.equal(torch.get_rng_state(), rng_before)  # seeded by `seed` alone
    assert weight.shape == (3, 8) and bias.shape == (3,)
    for rows in (slice(0, 90), slice(90, 120)):
        assert (linear_logits(x[rows], weight, bias).argmax(1) == y[rows]).all()
    again, _ = fit_linear_sgd(x[:90], y[:90], epochs=20, batch_size=16, seed=3)
    other, _ = fit_linear_sgd(x[:90], y[:90], epochs=20, batch_size=16, seed=4)
    assert torch.equal(weight, again) and not torch.equal(weight, other)


def test_sgd_steps_by_hand():
    # Two epochs of one full batch: T = 2 steps at lr·½(1 + cos(π t / 2)) = lr, lr / 2; momentum
    # 0.9 (PyTorch's buffer: b1 = g0, b2 = 0.9·b1 + g1); no weight decay; start W ~ N(0, 0.01²), b = 0.
    x, y = clusters(12, 4, 3, spread=1.0, seed=0)
    weight, bias = fit_linear_sgd(x, y, epochs=2, lr=0.5, batch_size=12, seed=7)

    def gradients(w, b):
        w, b = w.clone().requires_grad_(), b.clone().requires_grad_()
        F.cross_entropy(x.float() @ w.t() + b, y).backward()
        return w.grad, b.grad

    w0 = torch.randn(3, 4, generator=torch.Generator().manual_seed(7)) * 0.01
    b0 = torch.zeros(3)
    gw0, gb0 = gradients(w0, b0)
    w1, b1 = w0 - 0.5 * gw0, b0 - 0.5 * gb0
    gw1, gb1 = gradients(w1, b1)
    w2, b2 = w1 - 0.25 * (0.9 * gw0 + gw1), b1 - 0.25 * (0.9 * gb0 + gb1)
    torch.testing.assert_close(weight, w2)
    torch.testing.assert_close(bias, b2)


def test_stratified_split_keeps_class_proportions():
    labels = torch.tensor([0] * 50 + [1] * 30 + [2] * 10 + [3])
    fit, val = stratified_split(labels, 0.2, seed=0)
    assert sorted(torch.cat([fit, val]).tolist()) == list(range(len(labels)))
    assert torch.bincount(labels[val], minlength=4).tolist() == [10, 6, 2, 0]
    again, _ = stratified_split(labels, 0.2, seed=0)
    other, _ = stratified_split(labels, 0.2, seed=1)
    assert torch.equal(fit, again) and not torch.equal(fit, other)
    with pytest.raises(ClipkitError, match="validation fraction"):
        stratified_split(labels, 1.0)


def test_standardizer_uses_fit_statistics():
    x = torch.tensor([[1.0, 5.0], [3.0, 5.0]])
    scale = Standardizer.fit(x)
    torch.testing.assert_close(scale(x), torch.tensor([[-1.0, 0.0], [1.0, 0.0]]))  # constant: std 1
    assert torch.equal(Standardizer.identity(x)(x), x)


# ----------------------------------------------------------------------------------------------
# Frozen-feature extraction
# ----------------------------------------------------------------------------------------------


def images_of(model, samples) -> torch.Tensor:
    return torch.stack(
        [decode_transformed(s.image, model.transform, random.Random(0), s.key)[0] for s in samples]
    )


def small_model(registry, encoder: str, similarity: str = "dot", **options) -> ContrastiveModel:
    torch.manual_seed(0)
    image_encoder = registry.get("encoder", encoder).factory(embed_dim=16, image_size=32, **options)
    model = ContrastiveModel(
        image_encoder,
        None,
        registry.get("similarity", similarity).factory(),
        None,
        ImageTransform(image_size=32, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25)),
        "two_view",
    )
    return model.eval()


def test_vit_pre_projection_is_the_weighted_mean_of_the_tokens_before_proj(registry):
    model = small_model(registry, "vit_tiny", "kme", output="tokens", weights="softplus")
    samples, _ = load_samples(TEST, 6, registry=registry)
    features, used = image_features(model, samples, "pre_projection", batch_size=4, projection="proj")
    # The ViT forward by hand up to ln_post, then the point set's own weights.
    encoder, images = model.image_encoder, images_of(model, samples)
    with torch.no_grad():
        x = encoder.conv1(images).flatten(2).transpose(1, 2)
        x = torch.cat([encoder.class_embedding.expand(len(x), 1, -1), x], 1) + encoder.positional_embedding
        tokens = encoder.ln_post(encoder.transformer(encoder.ln_pre(x)))  # [B, 17, 64]
        weights = encoder(images).normalized_weights()
    assert used == "pre_projection" and features.shape == (6, 64)
    torch.testing.assert_close(features, (weights.unsqueeze(-1) * tokens).sum(1), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(features, tokens.mean(1), atol=1e-3)  # the weights matter
    # KME has no finite embedding: "embedding" falls back to the weighted point mean.
    embedded, used = image_features(model, samples, "embedding", batch_size=4)
    assert used == "points_mean"
    with torch.no_grad():
        torch.testing.assert_close(embedded, encoder(images).mean(), atol=1e-6, rtol=1e-6)


def test_conv_pre_projection_features(registry):
    samples, _ = load_samples(TEST, 4, registry=registry)
    resnet = small_model(registry, "resnet_tiny")
    assert projection_module_name(resnet.image_encoder) == "proj"
    features, _ = image_features(resnet, samples, "pre_projection", projection="proj")
    with torch.no_grad():
        pooled = resnet.image_encoder.features(images_of(resnet, samples)).mean(dim=(2, 3))
    torch.testing.assert_close(features, pooled, atol=1e-5, rtol=1e-5)

    clip_rn = small_model(registry, "rn_tiny")
    name = projection_module_name(clip_rn.image_encoder)
    assert name == "attnpool.c_proj"
    features, _ = image_features(clip_rn, samples, "pre_projection", projection=name)
    pool = clip_rn.image_encoder.attnpool
    with torch.no_grad():
        tokens = pool.tokens(clip_rn.image_encoder.features(images_of(clip_rn, samples)))
        q = pool.split_heads(pool.q_proj(tokens[:, :1]))  # the mean token queries all tokens
        k, v = pool.split_heads(pool.k_proj(tokens)), pool.split_heads(pool.v_proj(tokens))
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)[:, 0]
    torch.testing.assert_close(features, attended, atol=1e-5, rtol=1e-5)


class Unnamed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(3 * 32 * 32, 4)

    def forward(self, images):
        return PointSet(F.normalize(self.head(images.flatten(1)), dim=-1).unsqueeze(1))


def test_encoders_without_a_projection_name_get_a_clear_error(registry):
    with pytest.raises(ClipkitError, match="Unnamed does not name its final projection"):
        projection_module_name(Unnamed())
    named = Unnamed()
    named.projection_module_name = "head"
    assert projection_module_name(named) == "head"
    model = small_model(registry, "vit_tiny")
    model.image_encoder = named
    samples, _ = load_samples(TEST, 2, registry=registry)
    features, _ = image_features(model, samples, "pre_projection", projection="head")
    assert features.shape == (2, 3 * 32 * 32)
    with pytest.raises(ClipkitError, match="Unnamed has no submodule 'nope'"):
        image_features(model, samples, "pre_projection", projection="nope")


# ----------------------------------------------------------------------------------------------
# The eval task end to end, on an export
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """An (untrained, seeded) quickstart@smoke model written as an export and loaded back."""
    from clipkit.contract.manager import make_plugin_manager
    from clipkit.contract.registry import Registry

    registry = Registry(make_plugin_manager(autoload=False))
    recipe = api.resolve("quickstart@smoke", ["model.image_size=32"], registry)
    torch.manual_seed(0)
    out = write_export(
        build_model(recipe, registry), recipe, tmp_path_factory.mktemp("lp") / "export", registry
    )
    model, _ = load_export(out, registry)
    return model, registry


def probe(exported, **options) -> dict:
    model, registry = exported
    task = {
        "name": "linear_probe",
        "train": TRAIN,
        "test": TEST,
        "label": "colour",
        "max_iter": 100,
        **options,
    }
    # The task itself, not the suite runner (run_evals reports a failing task instead of raising).
    return {"name": "linear_probe", **build_slot(registry, "eval", task, "eval.0")(model, registry)}


def test_lbfgs_task_on_all_feature_kinds(exported):
    results = {
        kind: probe(exported, features=kind) for kind in ("embedding", "points_mean", "pre_projection")
    }
    for kind, result in results.items():
        json.dumps(result)  # JSON-serialisable
        assert result["features"] == kind and result["protocol"] == "lbfgs"
        counts = (result["n_train"], result["n_val"], result["n_test"], result["num_classes"])
        assert counts == (96, 18, 64, 8)
        assert result["chance"] == 1 / 8 and 0 <= result["top1"] <= result["top5"] <= 1
        # Colour is linearly decodable even from a random ViT's features.
        assert result["top1"] >= 4 * result["chance"], kind
        assert [result["l2"], result["val_top1"]] in result["search"] and len(result["search"]) >= 11
    assert results["embedding"]["features_used"] == "embed"
    assert results["pre_projection"]["feature_dim"] == 64  # vit_tiny's width (embed_dim is also 64)
    # dot's embed of a one-point set is that point, i.e. the point mean: same features, same probe.
    same = ("top1", "top5", "l2", "val_top1")
    assert [results["embedding"][k] for k in same] == [results["points_mean"][k] for k in same]


def test_sgd_task_and_fixed_l2(exported):
    result = probe(
        exported, protocol="sgd", features="pre_projection", standardize=True, epochs=20, sgd_batch_size=16
    )
    assert result["protocol"] == "sgd" and result["l2"] == 0.0 and result["standardize"] is True
    assert result["fit"] == {"lr": 0.05, "batch_size": 16, "epochs": 20, "momentum": 0.9}
    assert result["top1"] >= 4 * result["chance"]
    fixed = probe(exported, l2=1.0, limit_train=40, limit_test=20)
    assert (fixed["l2"], fixed["n_val"], fixed["n_train"], fixed["n_test"]) == (1.0, 0, 40, 20)
    assert "search" not in fixed


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"features": "cls"}, "features must be one of"),
        ({"protocol": "adam"}, "protocol must be one of"),
        ({"val_fraction": 1.5}, r"val_fraction must be in \(0, 1\)"),
        ({"l2": 0.0}, "l2 must be > 0"),
        ({"epochs": 0}, "epochs must be an integer >= 1"),
        ({"limit_train": 2.5}, "limit_train must be an integer >= 1"),
        ({"classnames": ["red", "red"]}, "twice"),
    ],
)
def test_bad_arguments(options, message):
    with pytest.raises(ClipkitError, match=message):
        LinearProbe(train=TRAIN, test=TEST, label="colour", **options)


def test_classes_from_the_data_or_a_standard_dataset(exported):
    # The source describes no classes for "size": they are the sorted distinct values.
    result = probe(exported, label="size", l2=1.0, limit_train=40, limit_test=20)
    assert result["num_classes"] == 2 and result["chance"] == 0.5 and "top5" not in result
    # baselines of the 20 test labels: the majority class's share, and 1/K for any constant answer
    baselines = result["baselines"]
    assert baselines["chance"] == {"top1": 0.5, "mean_per_class_recall": 0.5}
    assert 0.5 <= baselines["majority"]["top1"] < 1 and baselines["majority"]["class"] in ("small", "large")
    assert 0 <= result["mean_per_class_recall"] <= 1
    with pytest.raises(DataError, match="not among the probe.s 10 classes"):  # CIFAR-10's names
        probe(exported, dataset="cifar10", l2=1.0, limit_train=8, limit_test=8)


def test_bad_labels_and_registration(exported, registry):
    assert registry.get("eval", "linear_probe").factory is LinearProbe
    with pytest.raises(DataError, match="has no meta-data 'nope'"):
        probe(exported, label="nope")
    with pytest.raises(DataError, match="not among the probe's 2 classes"):
        probe(exported, classnames=["red", "green"])
    with pytest.raises(DataError, match="cannot be split"):
        probe(exported, limit_train=2)


def colour_folders(root, classes: dict[str, tuple[int, int, int]], per_class: int):
    """``root/<class>/<i>.png``: solid colours with a little seeded noise (a ``classes:`` source)."""
    from PIL import Image

    rng = random.Random(0)
    for name, rgb in classes.items():
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            shade = tuple(max(0, min(255, c + rng.randint(-20, 20))) for c in rgb)
            Image.new("RGB", (32, 32), shade).save(root / name / f"{i}.png")
    return f"classes:{root}"


RED, BLUE, GREEN = (230, 20, 20), (20, 20, 230), (20, 230, 20)


def test_folder_labels_are_matched_by_class_name_across_train_and_test(exported, tmp_path):
    # A classes: folder's labels are positions in its own sorted folder names: red is 1 in
    # {blue, red} but 0 in {red}. Matched by index, the red test images were scored as "blue".
    train = colour_folders(tmp_path / "train", {"blue": BLUE, "red": RED}, 8)
    red_only = colour_folders(tmp_path / "red_only", {"red": RED}, 5)
    result = probe(exported, train=train, test=red_only, label="label", l2=1e-3)
    assert result["num_classes"] == 2 and result["n_test"] == 5
    assert result["baselines"]["majority"]["class"] == "red"  # names, not 0 / 1
    assert result["top1"] == 1.0  # solid colours: the probe separates them
    mixed = colour_folders(tmp_path / "mixed", {"green": GREEN, "red": RED}, 3)
    with pytest.raises(DataError, match="class 'green' is not among the probe's 2 classes"):
        probe(exported, train=train, test=mixed, label="label", l2=1e-3)


def test_given_classnames_name_folder_classes_by_name_or_in_another_vocabulary(exported, tmp_path):
    train = colour_folders(tmp_path / "train", {"blue": BLUE, "red": RED}, 6)
    red_only = colour_folders(tmp_path / "red_only", {"red": RED}, 4)
    # by name, in any order: the red folder's label 0 is classnames' index 0 here
    result = probe(exported, train=train, test=red_only, label="label", classnames=["Red", "blue"], l2=1e-3)
    assert result["baselines"]["majority"]["class"] == "Red" and result["top1"] == 1.0
    # none of the names given: another vocabulary, matched by position when the counts agree
    other = probe(exported, train=train, test=train, label="label", classnames=["c0", "c1"], l2=1e-3)
    assert other["num_classes"] == 2 and other["top1"] == 1.0
    with pytest.raises(DataError, match="class 'blue' is not among"):  # one of two named: refused
        probe(exported, train=train, test=red_only, label="label", classnames=["red", "violet"])
