"""Embedding diagnostics (plugins/evals/diagnostic_stats.py) on hand-made data, and the
`diagnostics` eval task on tiny trained exports with the dot, WPSE and KME similarities."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from clipkit.app import api
from clipkit.artifacts.export import write_export
from clipkit.artifacts.reader import load_export
from clipkit.contract.manager import make_plugin_manager
from clipkit.contract.registry import Registry
from clipkit.eval.evaluate import encode_images, encode_texts, eval_generator, load_samples, run_evals
from clipkit.model import build_model
from clipkit.plugins.evals import diagnostic_stats as diagnostics
from clipkit.plugins.evals.diagnostics import Diagnostics

REGISTRY = Registry(make_plugin_manager(autoload=False))
TRAIN_SOURCE = "synthetic://shapes?n=32&split=train&image_size=48"
EVAL_DATA = "synthetic://shapes?split=heldout&n=24&seed=1&image_size=48"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny float64 matmuls through a 2-thread MKL take ~20 ms each (not µs) when the cores are
    oversubscribed, as on a busy CI machine; this file's hundreds of them run single-threaded."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def unit_rows(n: int, d: int, seed: int) -> torch.Tensor:
    """[n, d] uniform on S^{d-1} (normalised Gaussians), float64."""
    generator = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(n, d, generator=generator, dtype=torch.float64), dim=1)


def basis(d: int, *indices: int, scale: float = 1.0) -> torch.Tensor:
    return torch.stack([scale * torch.eye(d, dtype=torch.float64)[i] for i in indices])


# --- effective eigenvalues -------------------------------------------------------------------------


def test_three_equal_directions_give_three_effective_eigenvalues():
    # ±e1, ±e2, ±e3 in R^8: centred covariance diag(1/3, 1/3, 1/3, 0, ...).
    x = torch.cat([basis(8, 0, 1, 2), -basis(8, 0, 1, 2)])
    torch.testing.assert_close(
        diagnostics.covariance_eigenvalues(x)[:4], torch.tensor([1 / 3] * 3 + [0.0]).double()
    )
    assert diagnostics.effective_eigenvalues(x) == 3
    assert diagnostics.effective_eigenvalues(x, fraction=2 / 3) == 2  # exactly reached after two
    assert diagnostics.effective_eigenvalues(x, fraction=0.5) == 2


def test_one_dominant_direction():
    # ±10·e1, ±e2: eigenvalues 50 and 0.5, so the first holds 50/50.5 = 0.990099 of the trace.
    x = torch.cat([basis(4, 0, scale=10.0), -basis(4, 0, scale=10.0), basis(4, 1), -basis(4, 1)])
    assert diagnostics.effective_eigenvalues(x, fraction=0.99) == 1
    assert diagnostics.effective_eigenvalues(x, fraction=0.995) == 2


def test_covariance_is_centred_and_matches_numpy():
    x = unit_rows(40, 6, seed=0)
    expected = np.sort(np.linalg.eigvalsh(np.cov(x.numpy(), rowvar=False, bias=True)))[::-1]
    np.testing.assert_allclose(
        diagnostics.covariance_eigenvalues(x).numpy(), expected, rtol=1e-10, atol=1e-14
    )
    # A common offset changes neither the spectrum nor the count (an uncentred second moment would).
    assert diagnostics.effective_eigenvalues(x + 5.0) == diagnostics.effective_eigenvalues(x)
    assert diagnostics.effective_eigenvalues(torch.ones(5, 3)) == 0  # no variance at all
    assert diagnostics.covariance_eigenvalues(unit_rows(3, 7, seed=1)).shape == (7,)  # padded to D


# --- alignment and uniformity ----------------------------------------------------------------------


def test_alignment_and_uniformity_equal_a_naive_double_loop():
    x, y = unit_rows(7, 5, seed=2), unit_rows(7, 5, seed=3)
    for alpha in (2.0, 1.0):
        naive = sum(float((x[i] - y[i]).norm()) ** alpha for i in range(7)) / 7
        assert diagnostics.alignment(x, y, alpha) == pytest.approx(naive, rel=1e-12)
    for t in (2.0, 0.5):
        pairs = [
            math.exp(-t * float((x[i] - x[j]).norm()) ** 2) for i in range(7) for j in range(7) if i != j
        ]
        naive = math.log(sum(pairs) / len(pairs))
        assert diagnostics.uniformity(x, t) == pytest.approx(naive, rel=1e-12)
        assert diagnostics.uniformity(x, t, chunk=3) == pytest.approx(naive, rel=1e-12)  # row blocks


def test_uniformity_of_identical_and_antipodal_points():
    assert diagnostics.uniformity(basis(3, 0, 0, 0, 0)) == pytest.approx(0.0, abs=1e-12)
    assert diagnostics.uniformity(torch.cat([basis(3, 0), -basis(3, 0)]), t=2.0) == pytest.approx(-8.0)
    # k copies each of e1 and −e1: ordered pairs at distance 0: 2k(k−1), at distance 2: 2k².
    k = 3
    x = torch.cat([basis(3, *[0] * k), -basis(3, *[0] * k)])
    expected = math.log(((k - 1) + k * math.exp(-8.0)) / (2 * k - 1))
    assert diagnostics.uniformity(x, t=2.0, chunk=4) == pytest.approx(expected, rel=1e-12)


# --- uniformity tests on the sphere ----------------------------------------------------------------


def chi2_survival_reference(statistic: float, df: float) -> float:
    from scipy import stats  # imported here: ~1.5 CPU-s, which every xdist worker paid at collection

    return float(stats.chi2.sf(statistic, df))


def test_chi2_survival_matches_scipy():
    for statistic, df in ((3.0, 5), (0.0, 2), (700.0, 512), (131_000.0, 131_327.0), (40.0, 3)):
        assert diagnostics.chi2_survival(statistic, df) == pytest.approx(
            chi2_survival_reference(statistic, df), rel=1e-6, abs=1e-300
        )


def test_rayleigh_and_bingham_have_their_null_means_on_uniform_points():
    # E[R] = D and E[B] = (D−1)(D+2)/2 exactly under uniformity (any N); 400 samples of N = 20 in D = 5.
    d, n, seeds = 5, 20, 400
    rayleigh = [diagnostics.rayleigh_test(unit_rows(n, d, seed)) for seed in range(seeds)]
    bingham = [diagnostics.bingham_test(unit_rows(n, d, seed)) for seed in range(seeds)]
    r_mean = sum(r for r, _ in rayleigh) / seeds
    b_mean = sum(b for b, _ in bingham) / seeds
    assert r_mean == pytest.approx(d, abs=0.5)  # sd of R ≈ √(2D) = 3.2 -> se 0.16
    assert b_mean == pytest.approx((d - 1) * (d + 2) / 2, abs=1.0)  # sd ≈ √(2·14) = 5.3 -> se 0.26
    # p-values roughly uniform: mean 1/2 (se 0.014), and about 5 % below 0.05.
    assert sum(p for _, p in rayleigh) / seeds == pytest.approx(0.5, abs=0.06)
    assert sum(p < 0.05 for _, p in rayleigh) / seeds < 0.1
    r, p = diagnostics.rayleigh_test(unit_rows(n, d, 0))
    assert p == pytest.approx(chi2_survival_reference(r, d), rel=1e-9)


def test_rayleigh_is_huge_on_a_cluster_and_bingham_sees_a_flat_symmetric_cloud():
    noise = 0.1 * torch.randn(200, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    cluster = torch.nn.functional.normalize(basis(16, 0).expand(200, -1) + noise, dim=1)
    statistic, p = diagnostics.rayleigh_test(cluster)
    assert statistic > 2500 and p < 1e-100  # ≈ D·N·cos² = 16·200·0.86
    # Uniform on a great circle (in e1, e2), symmetric about 0: no mean direction, but anisotropic.
    angles = torch.linspace(0, 2 * math.pi, 201, dtype=torch.float64)[:-1]
    circle = torch.zeros(200, 16, dtype=torch.float64)
    circle[:, 0], circle[:, 1] = angles.cos(), angles.sin()
    assert diagnostics.rayleigh_test(circle)[0] == pytest.approx(0.0, abs=1e-9)
    statistic, p = diagnostics.bingham_test(circle)
    # tr(T²) = 2·(1/2)² = 1/2: B = (N·D·(D+2)/2)·(1/2 − 1/D).
    assert statistic == pytest.approx(0.5 * 200 * 16 * 18 * (0.5 - 1 / 16), rel=1e-9)
    assert p < 1e-100


def test_ajne_equals_its_formula_and_known_values():
    x = unit_rows(9, 4, seed=5)
    angle_sum = sum(
        math.acos(max(-1.0, min(1.0, float(x[i] @ x[j])))) for i in range(9) for j in range(i + 1, 9)
    )
    assert diagnostics.ajne_statistic(x, chunk=4) == pytest.approx(
        9 / 4 - angle_sum / (9 * math.pi), rel=1e-10
    )
    assert diagnostics.ajne_statistic(basis(3, 1, 1, 1, 1, 1)) == pytest.approx(5 / 4)  # all identical: N/4
    assert diagnostics.ajne_statistic(torch.cat([basis(3, 1, 1), -basis(3, 1, 1)])) == pytest.approx(
        0.0, abs=1e-12
    )
    # Orthonormal points: every ψ = π/2, A = N/4 − (N−1)/4 = 1/4, the null mean.
    assert diagnostics.ajne_statistic(basis(6, 0, 1, 2, 3, 4, 5)) == pytest.approx(0.25)
    null = [diagnostics.ajne_statistic(unit_rows(20, 5, seed)) for seed in range(200)]
    assert sum(null) / len(null) == pytest.approx(0.25, abs=0.05)


# --- modality gap and pair cosines -----------------------------------------------------------------


def test_modality_gap_of_shifted_clouds_is_the_shift():
    image = unit_rows(30, 6, seed=6)
    shift = torch.tensor([0.3, -0.4, 0.0, 1.2, 0.0, 0.0], dtype=torch.float64)
    assert diagnostics.modality_gap(image, image + shift) == pytest.approx(1.3, rel=1e-12)
    assert diagnostics.modality_gap(image, image[:10] * 0 + image.mean(0)) == pytest.approx(0.0, abs=1e-12)


def test_pair_cosines_equal_a_naive_double_loop():
    image, text = unit_rows(6, 4, seed=7), unit_rows(6, 4, seed=8)
    cos = image @ text.t()
    unmatched = sum(float(cos[i, j]) for i in range(6) for j in range(6) if i != j) / 30
    result = diagnostics.pair_cosines(image, text)
    assert result["matched"] == pytest.approx(float(cos.diagonal().mean()), rel=1e-12)
    assert result["unmatched"] == pytest.approx(unmatched, rel=1e-12)


# --- the eval task on tiny trained exports ---------------------------------------------------------


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Exports loaded back: quickstart@smoke (dot) trained 2 steps; wpse@imq_50_50+tiny and kme_clip@tiny
    exported at initialisation (training them would only cost time: the task's code path is the same)."""
    root = tmp_path_factory.mktemp("diagnostics")
    api.shard(TRAIN_SOURCE, root / "shards", registry=REGISTRY)
    overrides = [
        f"data.shards={root / 'shards'}",
        f"data.source={TRAIN_SOURCE}",
        "data.batch_size=16",
        "data.num_workers=0",
        "train.steps=2",
        "train.log_every=1",
        "train.checkpoint_every=2",
        "eval=[]",
    ]
    trained = api.train("quickstart@smoke", overrides, run_dir=root / "dot", registry=REGISTRY)
    models = {"dot": load_export(trained.export_dir, REGISTRY)[0]}
    for name, spec in (("wpse", "wpse@imq_50_50+tiny"), ("kme", "kme_clip@tiny")):
        torch.manual_seed(0)
        recipe = api.resolve(spec, [], REGISTRY)
        write_export(build_model(recipe, REGISTRY), recipe, root / name, REGISTRY)
        models[name] = load_export(root / name, REGISTRY)[0]
    return models


def test_task_on_a_dot_export_matches_direct_computation(exports):
    model = exports["dot"]
    [result] = run_evals(model, [{"name": "diagnostics", "data": EVAL_DATA, "limit": 20}], REGISTRY)
    json.dumps(result)  # JSON-serialisable
    assert result["name"] == "diagnostics" and result["n"] == 20 and result["dim"] == 64
    assert result["embedding"] == "similarity.embed"
    statistics = (
        "effective_eigenvalues",
        "uniformity",
        "ajne",
        "rayleigh",
        "rayleigh_p",
        "bingham",
        "bingham_p",
    )
    for value in (result[f"{key}_{modality}"] for key in statistics for modality in ("image", "text")):
        assert isinstance(value, float) and math.isfinite(value)
    # Independently: encode, take each sample's first caption, normalise.
    samples, _ = load_samples(EVAL_DATA, 20, registry=REGISTRY)
    image = torch.nn.functional.normalize(encode_images(model, samples).points[:, 0], dim=1)
    captions = [s.captions[0] for s in samples]
    text = torch.nn.functional.normalize(encode_texts(model, captions).points[:, 0], dim=1)
    assert result["alignment"] == pytest.approx(diagnostics.alignment(image, text), rel=1e-5)
    assert result["uniformity_text"] == pytest.approx(diagnostics.uniformity(text), rel=1e-5)
    assert result["effective_eigenvalues_image"] == diagnostics.effective_eigenvalues(image)
    # Through the model's own similarity: the dot logits' diagonal is scale·cosine of matched pairs.
    with torch.no_grad():
        logits = model.similarity(encode_images(model, samples), encode_texts(model, captions))
    matched = float(logits.i2t.diagonal().mean() / model.similarity.scale().detach())
    assert result["cosine_matched"] == pytest.approx(matched, rel=1e-4, abs=1e-6)
    # N points span at most N − 1 centred directions.
    assert 1 <= result["effective_eigenvalues_image"] <= 20 - 1


def test_wpse_uses_the_shared_random_feature_embedding_in_any_chunking(exports):
    model = exports["wpse"]
    samples, _ = load_samples(EVAL_DATA, 12, registry=REGISTRY)
    points = encode_images(model, samples)
    whole = Diagnostics(EVAL_DATA, batch_size=256).embed(model, points)
    chunked = Diagnostics(EVAL_DATA, batch_size=5).embed(model, points)
    torch.testing.assert_close(chunked, whole)  # every chunk re-seeds the export's eval generator
    expected = model.similarity.embed(points, generator=eval_generator(model))
    torch.testing.assert_close(whole, torch.nn.functional.normalize(expected, dim=1))
    result = Diagnostics(EVAL_DATA, limit=12, spectrum=True)(model, REGISTRY)
    assert result["dim"] == 64 + model.similarity.num_features
    assert result["embedding"] == "similarity.embed"
    assert len(result["spectrum_text"]) == result["dim"]
    assert sum(result["spectrum_text"]) == pytest.approx(1.0)
    assert all(math.isfinite(v) for v in result.values() if isinstance(v, float))


def test_kme_falls_back_to_the_normalised_point_mean(exports):
    model = exports["kme"]
    assert model.similarity.embed(encode_texts(model, ["a red square"])) is None
    samples, _ = load_samples(EVAL_DATA, 12, registry=REGISTRY)
    points = encode_texts(model, [s.captions[0] for s in samples])
    assert points.num_points > 1  # token point sets, so the fallback is a real pooling
    embedded = Diagnostics(EVAL_DATA, batch_size=5).embed(model, points)
    torch.testing.assert_close(embedded, torch.nn.functional.normalize(points.mean(), dim=1))
    result = Diagnostics(EVAL_DATA, limit=12, caption="random")(model, REGISTRY)
    assert result["dim"] == 64 and all(math.isfinite(v) for v in result.values() if isinstance(v, float))
    assert result["embedding"] == "point mean"
    assert result == Diagnostics(EVAL_DATA, limit=12, caption="random")(model, REGISTRY)  # seeded


def test_mean_embedding_option_uses_the_encoder_space(exports):
    model = exports["wpse"]
    samples, _ = load_samples(EVAL_DATA, 12, registry=REGISTRY)
    points = encode_texts(model, [s.captions[0] for s in samples])
    embedded = Diagnostics(EVAL_DATA, embedding="mean").embed(model, points)
    torch.testing.assert_close(embedded, torch.nn.functional.normalize(points.mean(), dim=1))
    result = Diagnostics(EVAL_DATA, limit=12, embedding="mean")(model, REGISTRY)
    assert result["dim"] == 64 and result["embedding"] == "point mean"


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="caption"):
        Diagnostics(EVAL_DATA, caption="all")
    with pytest.raises(ValueError, match="embedding"):
        Diagnostics(EVAL_DATA, embedding="tokens")
    with pytest.raises(ValueError, match="fraction"):
        Diagnostics(EVAL_DATA, fraction=1.5)
    with pytest.raises(ValueError, match="at least 2 rows"):
        diagnostics.uniformity(torch.ones(1, 3))


def test_caption_choice():
    samples, _ = load_samples(EVAL_DATA, 12, registry=REGISTRY)  # two captions per sample
    assert Diagnostics(EVAL_DATA, caption="first").pick_captions(samples) == [s.captions[0] for s in samples]
    picked = Diagnostics(EVAL_DATA, caption="random").pick_captions(samples)
    assert all(text in s.captions for text, s in zip(picked, samples, strict=True))
    assert any(text != s.captions[0] for text, s in zip(picked, samples, strict=True))
    assert picked == Diagnostics(EVAL_DATA, caption="random").pick_captions(samples)  # seeded
