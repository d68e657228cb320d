"""Contract checks for plugin authors: call them from your package's tests.

    from clipkit.contract.testing import check_loss, check_plugin

    def test_my_plugin():
        check_plugin(my_package.plugin)              # registers cleanly next to the built-ins

    def test_my_loss():
        check_loss(my_package.MyLoss())              # shapes, finiteness, gradients, requires

    def test_my_loss_tiles():
        check_tiled(my_package.MyLoss(), DotSimilarity())  # train.tiled: tiled equals full (float64)

    def test_my_loss_trains():
        check_training_step(["loss.name=my_loss"], plugin=my_package.plugin)  # clipkit's own step

Each check raises ``AssertionError`` with a message saying which contract was broken.
They use small random inputs on CPU and take well under a second.
"""

from __future__ import annotations

from typing import Any

import torch

from clipkit.contract.registry import KINDS, Registry
from clipkit.contract.types import (
    CONTEXT_FIELDS,
    DistillView,
    Logits,
    LossContext,
    LossOutput,
    PointSet,
    optional_member,
    similarity_metrics,
)


def random_points(
    batch: int = 6, points: int = 3, dim: int = 8, *, weighted: bool = False, seed: int = 0
) -> PointSet:
    """A PointSet [batch, points, dim] of unit vectors (and positive weights if ``weighted``)."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.nn.functional.normalize(torch.randn(batch, points, dim, generator=generator), dim=-1)
    weights = torch.rand(batch, points, generator=generator) + 0.1 if weighted else None
    return PointSet(values.requires_grad_(), weights)


def full_context(
    batch: int, requires: frozenset[str], a: PointSet, b: PointSet, similarity=None
) -> LossContext:
    """A LossContext holding every declared field with plausible values."""
    fields: dict[str, Any] = {}
    if "index" in requires:
        fields["index"] = torch.arange(batch) * 3
    if "meta" in requires:
        fields["meta"] = {"label": [i % 2 for i in range(batch)], "age": [20.0 + i for i in range(batch)]}
    if "in_modal" in requires:
        aa = a.mean() @ a.mean().t() if similarity is None else similarity(a, a).i2t
        bb = b.mean() @ b.mean().t() if similarity is None else similarity(b, b).i2t
        fields["in_modal"] = Logits(i2t=aa, t2i=bb)
    if "features" in requires:
        fields["features"] = (a, b)
    if "step" in requires:
        fields["step"] = 0
    if "epoch" in requires:
        fields["epoch"] = 0.0
    return LossContext(**fields)


def check_loss(loss, batch: int = 6, dim: int = 8) -> LossOutput:
    """A loss returns a finite scalar with gradients to the logits and float-able metrics."""
    requires = frozenset(getattr(loss, "requires", None) or frozenset())
    assert isinstance(getattr(loss, "requires", None), (frozenset, set)), (
        "a loss must define `requires` (a frozenset)"
    )
    assert requires <= CONTEXT_FIELDS, (
        f"requires {sorted(requires - CONTEXT_FIELDS)} are not LossContext fields"
    )
    a, b = random_points(batch, 1, dim, seed=1), random_points(batch, 1, dim, seed=2)
    i2t = (a.points[:, 0] @ b.points[:, 0].t()) * 10
    logits = Logits.symmetric(i2t)
    out = loss(logits, torch.arange(batch), full_context(batch, requires, a, b))
    assert isinstance(out, LossOutput), f"a loss must return LossOutput, got {type(out).__name__}"
    assert out.loss.dim() == 0, f"the loss must be a scalar, got shape {tuple(out.loss.shape)}"
    assert torch.isfinite(out.loss), f"the loss is not finite: {out.loss}"
    out.loss.backward()
    assert a.points.grad is not None and torch.isfinite(a.points.grad).all(), (
        "no finite gradient reaches the inputs"
    )
    for key, value in out.metrics.items():
        float(value)  # every metric must convert to a float for loggers
        assert isinstance(key, str), f"metric names must be strings, got {key!r}"
    check_optional_members(loss, ("supports_local_loss", "stateful", "compiles"))
    return out


def check_distill_loss(loss, batch: int = 6, dim: int = 8) -> LossOutput:
    """A distillation loss (``register_distill_losses``) maps a student and a teacher
    :class:`DistillView` (the teacher's without gradient, as the host hands it) to a finite scalar
    with a finite gradient to the student, and float-able metrics."""
    a, b = random_points(batch, 1, dim, seed=1), random_points(batch, 1, dim, seed=2)
    teacher_a, teacher_b = (
        random_points(batch, 1, dim, seed=3).detach(),
        random_points(batch, 1, dim, seed=4).detach(),
    )
    student_logits = Logits.symmetric((a.points[:, 0] @ b.points[:, 0].t()) * 10)
    teacher_logits = Logits.symmetric((teacher_a.points[:, 0] @ teacher_b.points[:, 0].t()) * 10)
    student = DistillView(student_logits, a.points[:, 0], b.points[:, 0])
    teacher = DistillView(teacher_logits, teacher_a.points[:, 0], teacher_b.points[:, 0])
    out = loss(student, teacher)
    assert isinstance(out, LossOutput), (
        f"a distillation loss must return LossOutput, got {type(out).__name__}"
    )
    assert out.loss.dim() == 0, f"the loss must be a scalar, got shape {tuple(out.loss.shape)}"
    assert torch.isfinite(out.loss), f"the loss is not finite: {out.loss}"
    assert out.loss.requires_grad, "the loss does not depend on the student"
    out.loss.backward()
    gradients = [t.grad for t in (a.points, b.points) if t.grad is not None]
    assert gradients and all(torch.isfinite(g).all() for g in gradients), (
        "no finite gradient reaches the student"
    )
    for key, value in out.metrics.items():
        float(value)
        assert isinstance(key, str), f"metric names must be strings, got {key!r}"
    check_optional_members(loss, ("compares_features",))
    return out


def _submodule(module, dotted: str):
    try:
        return module.get_submodule(dotted)
    except AttributeError:
        return None


def check_optional_members(plugin, names: tuple[str, ...]) -> None:
    """The optional members the host reads (:data:`clipkit.contract.types.OPTIONAL_MEMBERS`) have the declared
    types when a plugin sets them: booleans are bools, a projection name names a module."""
    for name in names:
        value = optional_member(plugin, name)
        if name == "projection_module_name":
            assert value is None or isinstance(_submodule(plugin, value), torch.nn.Module), (
                f"projection_module_name {value!r} names no sub-module of {type(plugin).__name__}"
            )
        else:
            assert isinstance(value, bool), f"{type(plugin).__name__}.{name} must be a bool, got {value!r}"
    for key, value in similarity_metrics(plugin).items():
        assert isinstance(key, str), f"metric names must be strings, got {key!r}"
        float(value)  # every metric must convert to a float for loggers


def check_similarity(similarity, dim: int = 8, points: int = 3, weighted: bool = False) -> Logits:
    """A similarity maps point sets to Logits of the right shapes, differentiably, and its
    ``embed`` (when not None) factorises it and ``ensemble`` returns one set per group."""
    a = random_points(5, points, dim, weighted=weighted, seed=1)
    b = random_points(4, points, dim, weighted=weighted, seed=2)
    generator = torch.Generator().manual_seed(0)
    logits = similarity(a, b, generator=generator)
    assert isinstance(logits, Logits), f"a similarity must return Logits, got {type(logits).__name__}"
    assert tuple(logits.i2t.shape) == (5, 4), f"i2t must be [Na, Nb] = (5, 4), got {tuple(logits.i2t.shape)}"
    assert tuple(logits.t2i.shape) == (4, 5), f"t2i must be [Nb, Na] = (4, 5), got {tuple(logits.t2i.shape)}"
    assert torch.isfinite(logits.i2t).all() and torch.isfinite(logits.t2i).all(), "logits must be finite"
    (logits.i2t.sum() + logits.t2i.sum()).backward()
    assert a.points.grad is not None and b.points.grad is not None, "gradients must reach both point sets"
    _check_embed(similarity, a, b)
    groups = torch.tensor([0, 0, 1, 2, 2])
    ensembled = similarity.ensemble(a, groups)
    assert isinstance(ensembled, PointSet) and ensembled.batch_size == 3, (
        "ensemble must return one set per group"
    )
    check_optional_members(similarity, ("pairwise", "uses_random_features", "compiles"))
    return logits


def _check_embed(similarity, a: PointSet, b: PointSet) -> None:
    with torch.no_grad():
        ea = similarity.embed(a, generator=torch.Generator().manual_seed(0))
        if ea is None:
            return
        eb = similarity.embed(b, generator=torch.Generator().manual_seed(0))
        logits = similarity(a, b, generator=torch.Generator().manual_seed(0)).i2t
    product = ea @ eb.t()
    # embed() may drop a positive scale and a constant: compare after removing both.
    centred = [(x - x.mean()) for x in (product, logits)]
    ratio = (centred[1] * centred[0]).sum() / (centred[0] * centred[0]).sum().clamp_min(1e-12)
    assert ratio > 0, "embed(a) @ embed(b).T must increase with the logits"
    torch.testing.assert_close(centred[0] * ratio, centred[1], atol=1e-4, rtol=1e-4)


def check_encoder(encoder, inputs: torch.Tensor, *, normalized: bool = True) -> PointSet:
    """An encoder returns a PointSet [B, M, d] (unit points unless ``normalized=False``), differentiable."""
    out = encoder(inputs)
    assert isinstance(out, PointSet), f"an encoder must return PointSet, got {type(out).__name__}"
    assert out.batch_size == inputs.shape[0], "one point set per input"
    if normalized:
        norms = out.points.norm(dim=-1)
        torch.testing.assert_close(norms, torch.ones_like(norms), atol=1e-4, rtol=1e-4)
    if out.weights is not None and out.weight_normalization == "sum":
        # Only "count" weights (the WPSE code's signed weights) may be zero or negative.
        assert (out.weights > 0).all(), "point weights must be positive"
    out.points.sum().backward()
    assert any(p.grad is not None for p in encoder.parameters()), "no parameter received a gradient"
    check_optional_members(encoder, ("projection_module_name",))
    return out


def check_plugin(plugin, *, with_builtins: bool = True) -> Registry:
    """The plugin registers under the ``clipkit`` hooks, with no misspelled hooks and no
    name clashing with the built-ins; returns the resulting registry."""
    from clipkit.contract.manager import make_plugin_manager

    pm = (
        make_plugin_manager(autoload=False, extra_plugins=[plugin])
        if with_builtins
        else _bare_manager(plugin)
    )
    registry = Registry(pm)
    name = pm.get_name(plugin)
    registered = registry.by_plugin().get(name, {})
    hooks = [caller.name for caller in pm.get_hookcallers(plugin) or []]
    assert hooks, f"plugin {name!r} implements no clipkit hook"
    assert registered or any(not h.startswith("register_") or h == "register_commands" for h in hooks), (
        f"plugin {name!r} implements registration hooks but registered nothing"
    )
    assert set(registered) <= set(KINDS)
    return registry


def _bare_manager(plugin):
    import pluggy

    from clipkit.contract import hookspecs

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(plugin)
    pm.check_pending()
    return pm


def check_training_step(
    overrides: list[str] | tuple[str, ...] = (),
    *,
    plugin=None,
    recipe: str = "quickstart@smoke",
    batch_size: int = 8,
    seed: int = 0,
) -> LossOutput:
    """Your plugin inside clipkit's own training step: ``recipe`` (a tiny image–text model) with
    ``overrides`` (e.g. ``["loss.name=my_loss"]``), built with ``plugin`` registered beside the
    built-ins, runs one forward and backward of :class:`clipkit.train.step.TrainingStep` — the module
    the training loop runs — on a seeded in-memory batch of ``batch_size`` samples. Checks that the
    loss is finite and that every trainable parameter of the towers and the similarity gets a
    finite gradient; returns the loss's output.
    """
    from clipkit.config.recipe import load_recipe, validate_or_raise
    from clipkit.contract.manager import make_plugin_manager
    from clipkit.model import build_model
    from clipkit.train.objective import build_objective
    from clipkit.train.step import TrainingStep

    extra = [] if plugin is None else [plugin]
    registry = Registry(make_plugin_manager(autoload=False, extra_plugins=extra))
    resolved = load_recipe(recipe, [*overrides, f"data.batch_size={batch_size}"], registry=registry)
    validate_or_raise(resolved, registry)
    torch.manual_seed(seed)
    model = build_model(resolved, registry)
    step = TrainingStep(model, build_objective(resolved, registry, model, num_samples=batch_size))
    loss, out = step(synthetic_batch(model, batch_size, int(resolved["model"]["image_size"]), seed), 0, 0.0)
    assert isinstance(out, LossOutput) and torch.isfinite(loss), f"the step's loss is {loss}"
    loss.backward()
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    missing = [name for name, p in trainable if p.grad is None]
    assert len(missing) < len(trainable), "no trainable parameter got a gradient from the step"
    bad = [name for name, p in trainable if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert not bad, f"non-finite gradients: {bad[:5]}"
    return out


def synthetic_batch(model, batch_size: int, image_size: int, seed: int = 0) -> dict:
    """A seeded batch as the loader yields it: ``image`` [B, 3, S, S], ``text`` [B, L] tokens of
    made-up captions (the model's tokenizer), ``index`` [B], empty ``meta``."""
    generator = torch.Generator().manual_seed(seed)
    words = ["red", "green", "blue", "circle", "square", "big", "small", "star", "left", "right"]
    picks = torch.randint(len(words), (batch_size, 4), generator=generator).tolist()
    captions = [" ".join(words[i] for i in row) for row in picks]
    return {
        "image": torch.randn(batch_size, 3, image_size, image_size, generator=generator),
        "text": model.tokenizer(captions),
        "index": torch.arange(batch_size),
        "meta": {},
    }


def check_tiled(
    loss,
    similarity,
    *,
    batch: int = 13,
    tile_size: int = 4,
    dim: int = 8,
    points: int = 3,
    weighted: bool = False,
    local_rows: tuple[int, int] | None = None,
    pair: tuple[PointSet, PointSet] | None = None,
    tolerance: float = 1e-9,
    fused: bool | None = None,
) -> tuple[LossOutput, LossOutput]:
    """ "Tiled equals full" (``train.tiled``, :mod:`clipkit.tiled.contract`) in float64: the loss, its
    metrics and the gradients of the points, weights and similarity parameters agree within
    ``tolerance`` (relative to the values' size). ``batch`` is odd and ``tile_size`` does not divide it
    by default, so ragged last tiles are exercised. ``local_rows`` = (offset, n): also check the
    ``local_loss`` form (anchors offset .. offset + n − 1 against the whole batch). The plugins are
    deep-copied per run, so per-sample state is not carried over. ``fused``: passed to the tiled call
    (True: the fused Triton kernels, :mod:`clipkit.tiled.fused`). Returns (full, tiled) outputs.
    """
    import copy

    from clipkit.tiled.contract import refusal, tiled_global_loss, tiled_local_loss

    reason = refusal(loss, similarity)
    assert reason is None, f"not tileable: {reason}"
    if pair is None:
        pair = (random_points(batch, points, dim, weighted=weighted, seed=1),
                random_points(batch, points, dim, weighted=weighted, seed=2))  # fmt: skip
    a, b = (_as_float64_leaves(x) for x in pair)
    base = copy.deepcopy(similarity).double()

    def run(tiled: bool) -> tuple[LossOutput, list]:
        this_loss, this_similarity = copy.deepcopy(loss), copy.deepcopy(base)
        ctx = full_context(a.batch_size, optional_member(loss, "requires"), a, b, this_similarity)
        if local_rows is None:
            targets = torch.arange(a.batch_size)
            out = (tiled_global_loss(this_loss, this_similarity, a, b, ctx, tile_size=tile_size, fused=fused)
                   if tiled else this_loss(this_similarity(a, b), targets, ctx))  # fmt: skip
        else:
            offset, n = local_rows
            local_a, local_b = a.rows(offset, offset + n), b.rows(offset, offset + n)
            if tiled:
                out = tiled_local_loss(this_loss, this_similarity, local_a, b, a, local_b, offset, ctx,
                                       tile_size=tile_size, fused=fused)  # fmt: skip
            else:
                logits = Logits(this_similarity(local_a, b).i2t, this_similarity(a, local_b).t2i)
                out = this_loss(logits, offset + torch.arange(n), ctx)
        leaves = [t for t in (*a[:2], *b[:2]) if t is not None]
        leaves += [p for p in this_similarity.parameters() if p.requires_grad]
        grads = torch.autograd.grad(out.loss, leaves, allow_unused=True)
        return out, grads

    (full, full_grads), (tiled, tiled_grads) = run(False), run(True)
    _assert_close("loss", full.loss, tiled.loss, tolerance)
    assert set(full.metrics) == set(tiled.metrics), (
        f"metrics differ: {sorted(full.metrics)} vs {sorted(tiled.metrics)}"
    )
    for key, value in full.metrics.items():
        _assert_close(f"metric {key}", torch.as_tensor(value), torch.as_tensor(tiled.metrics[key]), tolerance)
    for index, (want, got) in enumerate(zip(full_grads, tiled_grads, strict=True)):
        if want is None or got is None:
            assert want is None or float(want.abs().max()) == 0, f"gradient {index}: tiled has none"
            continue
        _assert_close(f"gradient {index}", want, got, tolerance)
    return full, tiled


def _as_float64_leaves(x: PointSet) -> PointSet:
    """A float64 copy of ``x`` whose points (and weights) are fresh leaves that require grad."""
    weights = None if x.weights is None else x.weights.detach().double().requires_grad_()
    return PointSet(x.points.detach().double().requires_grad_(), weights, x.mask, x.weight_normalization)


def _assert_close(what: str, want: torch.Tensor, got: torch.Tensor, tolerance: float) -> None:
    want, got = want.detach().double(), got.detach().double()
    scale = max(1.0, float(want.abs().max()) if want.numel() else 1.0)
    error = float((want - got).abs().max()) if want.numel() else 0.0
    assert error <= tolerance * scale, (
        f"tiled != full for {what}: max |difference| {error:.3g} (scale {scale:.3g})"
    )
