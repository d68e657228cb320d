"""``train.compile_scope: step``: the similarity + loss compiled with the towers where both plugins
declare ``compiles``, an eager fallback (with its reason) where not, the strategies' refusal, and
the warm compile reported apart from the steady speed (clipkit.train.compile, telemetry)."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
from smoke_data import place_smoke_shards

from clipkit.config.recipe import load_recipe, validate_or_raise
from clipkit.config.settings_schema import DistributedConfig
from clipkit.contract.types import LossOutput, PointSet, optional_member
from clipkit.errors import ClipkitError
from clipkit.plugins.losses.infonce import InfoNCE
from clipkit.plugins.similarities.dot import DotSimilarity
from clipkit.plugins.similarities.wpse import WPSESimilarity
from clipkit.train.build import build_trainer, compile_objective
from clipkit.train.compile import compile_unavailable, scoring_graph_breaks, scoring_refusal
from clipkit.train.objective import Objective
from clipkit.train.runtime import Runtime
from clipkit.train.telemetry import Telemetry

BATCH, DIM = 6, 8


@pytest.fixture(autouse=True, scope="module")
def restore_environment():
    """Inductor exports a pointer into this process into os.environ while compiling
    (tests/test_compile.py says why later launches must not inherit it)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def runtime():
    return Runtime(global_batch_size=BATCH)


def unit_points(seed: int, points: int = 1) -> PointSet:
    """[BATCH, points, DIM] unit vectors that require a gradient."""
    x = torch.randn(BATCH, points, DIM, generator=torch.Generator().manual_seed(seed))
    return PointSet(torch.nn.functional.normalize(x, dim=-1).requires_grad_())


def test_every_plugin_declaring_compiles_traces_into_one_graph(registry, runtime):
    """The capability is checked, not trusted: for each registered similarity and loss declaring
    ``compiles``, TorchDynamo traces the scoring (similarity + loss, forward) into one graph with no
    break (``torch._dynamo.explain``: tracing only, no compile). Each loss is paired with ``dot``,
    each similarity with InfoNCE; each declaring plugin is built with its defaults."""
    declared = {"similarity": [], "loss": []}
    for kind in declared:
        for name in registry.names(kind):
            factory = registry.get(kind, name, where=kind).factory
            if optional_member(factory, "compiles"):  # the built-ins are classes declaring it
                declared[kind].append((name, factory()))
    assert {"dot", "cosine_mean"} <= {name for name, _ in declared["similarity"]}
    assert {"infonce", "siglip"} <= {name for name, _ in declared["loss"]}
    pairs = [(f"{name}+infonce", similarity, InfoNCE()) for name, similarity in declared["similarity"]]
    pairs += [(f"dot+{name}", DotSimilarity(), loss) for name, loss in declared["loss"]]
    a, b = unit_points(1), unit_points(2)
    for label, similarity, loss in pairs:
        objective = Objective(loss, similarity, runtime)
        assert scoring_refusal(objective) is None, label
        report = scoring_graph_breaks(objective, a, b, {"index": torch.arange(BATCH)})
        assert (report.graphs, report.breaks) == (1, []), (label, report)


def test_plugins_that_cannot_compile_fall_back_with_the_reason(runtime, capsys):
    """WPSE (a generator, and no ``compiles``), the tiled engine and a loss reading per-step Python
    numbers keep eager scoring; ``compile_objective`` says why in one line."""
    wpse = Objective(InfoNCE(), WPSESimilarity(embed_dim=DIM, num_features=16), runtime)
    assert "WPSESimilarity does not declare `compiles`" in scoring_refusal(wpse)
    compile_objective(wpse, "default", announce=True)
    assert wpse.compiled_scoring is None
    line = capsys.readouterr().err.strip()
    assert line.startswith("train.compile_scope=step: similarity and loss stay eager: the similarity WPSE")
    assert "\n" not in line

    tiled = Objective(InfoNCE(), DotSimilarity(), runtime, tile_size=4)
    assert "tiled" in scoring_refusal(tiled)

    class StepLoss(InfoNCE):
        compiles = True
        requires = frozenset({"step", "index"})

    assert "reads step, which would recompile every step" in scoring_refusal(
        Objective(StepLoss(), DotSimilarity(), runtime)
    )
    assert scoring_refusal(Objective(InfoNCE(), DotSimilarity(), runtime)) is None


def test_compiled_scoring_matches_eager_loss_metrics_and_gradients(runtime):
    """The compiled similarity + loss — TorchDynamo's graph, AOTAutograd's forward and backward
    graphs, run by eager kernels (``aot_eager``: Inductor's C++ compile would add 15-50 s to the
    suite; tests/test_compile.py checks Inductor's kernels on the towers) — against eager scoring on
    the same inputs: loss and metrics agree to float32 rounding (1e-6), and so do the gradients of
    both feature sets and of the learnable log scale (1e-5 of each tensor's largest entry; a wrong
    graph is off by order 1)."""
    from clipkit.train.compile import compile_scoring

    reason = compile_unavailable()
    if reason:
        pytest.skip(reason)
    similarity = DotSimilarity()
    eager = Objective(InfoNCE(label_smoothing=0.1), similarity, runtime)
    compiled = Objective(InfoNCE(label_smoothing=0.1), copy.deepcopy(similarity), runtime)
    compiled.compiled_scoring = compile_scoring(compiled, "default", backend="aot_eager")
    results = []
    for objective in (eager, compiled):
        a, b = unit_points(3), unit_points(4)
        out = objective(a, b, {}, step=0, epoch=0.0)
        assert isinstance(out, LossOutput)
        out.loss.backward()
        grads = [a.points.grad, b.points.grad, objective.similarity.log_scale.grad]
        results.append((out, grads))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=1e-6)
    assert set(got.metrics) == set(want.metrics) == {"loss_i2t", "loss_t2i", "acc_i2t"}
    for key in want.metrics:
        torch.testing.assert_close(got.metrics[key], want.metrics[key], rtol=1e-6, atol=1e-6)
    for want_grad, got_grad in zip(want_grads, got_grads, strict=True):
        assert got_grad is not None and float(want_grad.abs().max()) > 1e-3
        error = float((got_grad - want_grad).abs().max())
        assert error <= 1e-5 * float(want_grad.abs().max()), error


def recipe_for(registry, *overrides: str):
    return validate_or_raise(load_recipe("quickstart@smoke", list(overrides), registry=registry), registry)


def test_zero3_refuses_train_compile_before_anything_is_built(registry, in_tmp):
    """ZeRO-3's per-module gathering hooks make TorchDynamo recompile (docs/distributed.md): a
    one-line refusal with what to do, raised right after the runtime (no data read, nothing written)
    for a recipe that skipped validation (which refuses it first: tests/test_settings_without_effect.py)."""
    zero3 = ["train.distributed.strategy=deepspeed", "train.distributed.zero_stage=3"]
    recipe = load_recipe(
        "quickstart@smoke", [*zero3, "train.compile=default", "train.compile_scope=step"], registry=registry
    )
    with pytest.raises(ClipkitError) as refused:
        build_trainer(recipe, Path(in_tmp / "run"), registry)
    message = str(refused.value)
    assert message.startswith("train.compile=default: under ZeRO-3 TorchDynamo traces DeepSpeed's")
    assert "zero_stage 1 or 2" in message
    assert "\n" not in message
    assert not (in_tmp / "data").exists()
    for strategy in (DistributedConfig(), DistributedConfig(strategy="deepspeed", zero_stage=2)):
        assert Runtime(distributed=strategy, global_batch_size=BATCH).compile_refusal is None


def test_compile_scope_step_compiles_towers_and_scoring(registry, in_tmp, smoke_shards):
    """``compile_scope: step`` wires both (compiling itself is lazy: nothing runs here);
    ``towers``, the default, leaves the similarity + loss eager as ``train.compile`` always did."""
    from clipkit.train.compile import is_compiled

    if compile_unavailable():
        pytest.skip(compile_unavailable())
    place_smoke_shards(in_tmp, smoke_shards)
    for scope, scoring in (("towers", False), ("step", True)):
        recipe = recipe_for(registry, "train.compile=default", f"train.compile_scope={scope}")
        trainer = build_trainer(recipe, Path(in_tmp / scope), registry)
        assert is_compiled(trainer.model.image_encoder) and is_compiled(trainer.model.text_encoder)
        assert (trainer.objective.compiled_scoring is not None) == scoring, scope


def test_compile_unit_block_compiles_the_blocks_of_the_built_model(registry, in_tmp, smoke_shards):
    """``train.compile_unit: block`` reaches the trainer's model: its towers' layers are compiled,
    the towers themselves are not (lazy: nothing compiles here)."""
    from clipkit.train.compile import compiled_units, is_compiled

    if compile_unavailable():
        pytest.skip(compile_unavailable())
    place_smoke_shards(in_tmp, smoke_shards)
    recipe = recipe_for(registry, "train.compile=default", "train.compile_unit=block")
    model = build_trainer(recipe, Path(in_tmp / "block"), registry).model
    layers = compiled_units(model, "block")
    assert len(layers) >= 2 and all(is_compiled(layer) for layer in layers)
    assert not is_compiled(model.image_encoder) and not is_compiled(model.text_encoder)


def test_warm_compile_is_reported_apart_from_the_steady_speed():
    """The first (compiling) step's wall time is its own field; the interval's speed counts only the
    steps after it; an interval that held only the warm compile reports no speed."""
    telemetry = Telemetry(torch.device("cpu"), world_size=2)
    telemetry.steps = 1
    telemetry.data_wait_s = 5.0
    telemetry.warm_compile(12.5)
    telemetry.steps = 2  # two steady steps of 8 global samples each, in 0.4 s
    first = telemetry.interval_metrics(samples=16, elapsed_s=0.4)
    assert first["compile_warmup_s"] == 12.5
    assert first["samples_per_s_per_device"] == pytest.approx(16 / 0.4 / 2)
    assert first["step_ms"] == pytest.approx(200.0) and first["data_wait_share"] == 0.0
    telemetry.steps = 1
    assert "compile_warmup_s" not in telemetry.interval_metrics(samples=8, elapsed_s=0.2)

    telemetry.steps = 1
    telemetry.warm_compile(3.0)
    only_warmup = telemetry.interval_metrics(samples=0, elapsed_s=0.0)
    assert only_warmup["compile_warmup_s"] == 3.0
    assert "samples_per_s_per_device" not in only_warmup and "step_ms" not in only_warmup


def test_the_loop_logs_the_first_step_apart_when_compiling(registry, in_tmp, capsys, smoke_shards):
    """``train_loop`` with ``train.compile`` set times its first step apart: the log line carries
    ``compile_warmup_s`` and its samples/s counts the later steps only. The towers stay eager here
    (the setting is switched on after building): what is tested is the loop's bookkeeping."""
    import dataclasses

    from clipkit.train.build import prepare_run_dir
    from clipkit.train.loop import train_loop

    place_smoke_shards(in_tmp, smoke_shards)

    recipe = recipe_for(registry, "train.steps=3", "train.log_every=3", "train.export=false")
    prepare_run_dir(recipe, in_tmp / "run", resume=False)
    trainer = build_trainer(recipe, Path(in_tmp / "run"), registry)
    trainer.settings = dataclasses.replace(trainer.settings, compile="default")
    metrics = train_loop(trainer)
    assert metrics["compile_warmup_s"] > 0 and metrics["samples_per_s"] > 0
    assert metrics["samples_per_s_per_device"] == pytest.approx(
        2 * trainer.runtime.plan.global_size / (metrics["step_ms"] * 2 / 1e3)
    )
    assert "train.compile: the first step took" in capsys.readouterr().err


def test_a_run_with_distillation_keeps_its_scoring_eager_with_the_reason():
    """train.distill adds the teacher's terms from the logits in eager code: compile_scope: step
    falls back (the towers still compile) instead of dropping the teacher."""
    from types import SimpleNamespace

    from clipkit.train.compile import scoring_refusal

    objective = SimpleNamespace(tile_size=None, distill=object(), similarity=None, loss=None)
    assert "train.distill" in scoring_refusal(objective)
