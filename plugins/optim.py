"""Built-in optimizers (`adamw`, `adam`, `sgd`, `lamb`) and learning-rate schedules (`cosine`,
`constant`, `cosine_restarts`, `step`).

Optimizer factories take ``named_parameters`` (a list of ``(name, parameter)``) and build
their own parameter groups (:mod:`clipkit.plugins.optim_groups`): weight decay applies to
matrices and convolution kernels only, never to gains, biases, embeddings' scalars or
temperatures (CLIP, CLOOB, open_clip all exclude them; a decayed temperature drifts towards
s = 1); each tower and the similarity may have their own learning rate and weight decay, and
each tower a layer-wise learning-rate decay.
"""

from __future__ import annotations

import math
from typing import Annotated

from clipkit.config.settings_schema import Numbers, OneOf, Range
from clipkit.contract.hookspecs import hookimpl
from clipkit.errors import ClipkitError
from clipkit.plugins.optim_groups import GroupRule, parameter_groups

# Ranges `clipkit validate` checks (docs/plugins.md, "Declaring ranges").
LR = Annotated[float, Range(gt=0)]
NON_NEGATIVE = Annotated[float, Range(ge=0)]
STEPS = Annotated[int, Range(ge=0)]
BETA = Annotated[float, Range(ge=0, lt=1)]
# Adam's (β1, β2): exactly two, each in [0, 1) (torch would read the first two of a longer list).
BETAS = Annotated[tuple[float, float], Numbers(2, Range(ge=0, lt=1))]
# Per-group settings: unset (None) takes the optimizer's own lr / weight_decay / layer_decay.
GROUP_LR = Annotated[float | None, Range(gt=0)]
GROUP_DECAY = Annotated[float | None, Range(ge=0)]
LAYER_DECAY = Annotated[float | None, Range(gt=0, le=1)]


#: ``implementation`` of adamw/adam: torch's kernels for the update of all parameters.
IMPLEMENTATIONS = ("auto", "fused", "foreach", "for_loop")


def kernel_choice(implementation: str, cuda: bool) -> dict:
    """torch.optim's ``fused`` / ``foreach`` flags for ``implementation``.

    auto: fused (one kernel for every parameter's update) when training on CUDA, where it is the
    fastest; on the CPU torch's own default (the per-parameter loop), which keeps CPU runs and
    their golden values as they were. The device check of ``fused`` happens at the first step, so
    the optimiser may be built before the model moves to the GPU.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "auto":
        implementation = "fused" if cuda else "default"
    return {
        "fused": {"fused": True, "foreach": False},
        "foreach": {"fused": False, "foreach": True},
        "for_loop": {"fused": False, "foreach": False},
        "default": {},
    }[implementation]


def trains_on_cuda() -> bool:
    """The runtime trains on CUDA whenever it is available (clipkit.train.runtime)."""
    import torch

    return torch.cuda.is_available()


def adamw(
    named_parameters,
    lr: LR = 5e-4,
    weight_decay: NON_NEGATIVE = 0.2,
    betas: BETAS = (0.9, 0.98),
    eps: Annotated[float, Range(gt=0)] = 1e-6,
    implementation: Annotated[str, OneOf(IMPLEMENTATIONS)] = "auto",
    layer_decay: Annotated[float, Range(gt=0, le=1)] = 1.0,
    image_lr: GROUP_LR = None,
    text_lr: GROUP_LR = None,
    similarity_lr: GROUP_LR = None,
    image_weight_decay: GROUP_DECAY = None,
    text_weight_decay: GROUP_DECAY = None,
    similarity_weight_decay: GROUP_DECAY = None,
    image_layer_decay: LAYER_DECAY = None,
    text_layer_decay: LAYER_DECAY = None,
):
    """AdamW with CLIP's defaults (β2 = 0.98, ε = 1e-6) and decay on matrices only; per-tower and
    similarity groups, layer-wise lr decay (:func:`clipkit.plugins.optim_groups.parameter_groups`);
    fused on CUDA (``implementation``: :func:`kernel_choice`)."""
    import torch

    rule = GroupRule.of(locals())
    return torch.optim.AdamW(
        parameter_groups(named_parameters, rule),
        lr=lr,
        betas=tuple(betas),
        eps=eps,
        **kernel_choice(implementation, trains_on_cuda()),
    )


def adam(
    named_parameters,
    lr: LR = 1e-3,
    weight_decay: NON_NEGATIVE = 0.0,
    betas: BETAS = (0.9, 0.999),
    eps: Annotated[float, Range(gt=0)] = 1e-8,
    implementation: Annotated[str, OneOf(IMPLEMENTATIONS)] = "auto",
    layer_decay: Annotated[float, Range(gt=0, le=1)] = 1.0,
    image_lr: GROUP_LR = None,
    text_lr: GROUP_LR = None,
    similarity_lr: GROUP_LR = None,
    image_weight_decay: GROUP_DECAY = None,
    text_weight_decay: GROUP_DECAY = None,
    similarity_weight_decay: GROUP_DECAY = None,
    image_layer_decay: LAYER_DECAY = None,
    text_layer_decay: LAYER_DECAY = None,
):
    """Adam with L2 weight decay coupled into the gradient (y-Aware, seed 002: lr 1e-3, wd 5e-5),
    on matrices only; groups as :func:`adamw`'s; fused on CUDA (``implementation``)."""
    import torch

    rule = GroupRule.of(locals())
    return torch.optim.Adam(
        parameter_groups(named_parameters, rule),
        lr=lr,
        betas=tuple(betas),
        eps=eps,
        **kernel_choice(implementation, trains_on_cuda()),
    )


def sgd(
    named_parameters,
    lr: LR = 0.1,
    momentum: BETA = 0.9,
    weight_decay: NON_NEGATIVE = 0.0,
    nesterov: bool = False,
    layer_decay: Annotated[float, Range(gt=0, le=1)] = 1.0,
    image_lr: GROUP_LR = None,
    text_lr: GROUP_LR = None,
    similarity_lr: GROUP_LR = None,
    image_weight_decay: GROUP_DECAY = None,
    text_weight_decay: GROUP_DECAY = None,
    similarity_weight_decay: GROUP_DECAY = None,
    image_layer_decay: LAYER_DECAY = None,
    text_layer_decay: LAYER_DECAY = None,
):
    """SGD with momentum (linear probes, seed 000's protocol); groups as :func:`adamw`'s."""
    import torch

    rule = GroupRule.of(locals())
    return torch.optim.SGD(
        parameter_groups(named_parameters, rule), lr=lr, momentum=momentum, nesterov=nesterov
    )


#: The optional extra that brings LAMB (pytorch-optimizer, a maintained library).
LAMB_EXTRA = "lamb"


def lamb(
    named_parameters,
    lr: LR = 1e-3,
    weight_decay: NON_NEGATIVE = 0.01,
    betas: BETAS = (0.9, 0.999),
    eps: Annotated[float, Range(gt=0)] = 1e-6,
    layer_decay: Annotated[float, Range(gt=0, le=1)] = 1.0,
    image_lr: GROUP_LR = None,
    text_lr: GROUP_LR = None,
    similarity_lr: GROUP_LR = None,
    image_weight_decay: GROUP_DECAY = None,
    text_weight_decay: GROUP_DECAY = None,
    similarity_weight_decay: GROUP_DECAY = None,
    image_layer_decay: LAYER_DECAY = None,
    text_layer_decay: LAYER_DECAY = None,
):
    """LAMB (You et al. 2020: Adam's step rescaled per tensor by the trust ratio ‖w‖/‖update‖,
    decoupled weight decay) from ``pytorch-optimizer``'s ``Lamb``; groups as :func:`adamw`'s."""
    try:
        from pytorch_optimizer import Lamb
    except ImportError as error:
        from clipkit import install_hint

        raise ClipkitError(
            f"optimizer.name=lamb needs the pytorch-optimizer package, which is not installed ({error}); "
            f"install the extra: {install_hint(LAMB_EXTRA)}"
        ) from error
    rule = GroupRule.of(locals())
    groups = parameter_groups(named_parameters, rule)
    return Lamb(groups, lr=lr, betas=tuple(betas), eps=eps, weight_decouple=True)


def warmup_cosine_factor(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """Multiplier of the base lr: linear warm-up from ~0 to 1, then cosine down to ``min_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def cosine(
    optimizer,
    total_steps: int,
    warmup_steps: STEPS = 0,
    min_lr_ratio: Annotated[float, Range(ge=0, le=1)] = 0.0,
):
    """Cosine decay with linear warm-up (CLIP, WPSE, NUCLR)."""
    import torch

    if warmup_steps < 0 or total_steps <= 0:
        raise ValueError(f"need total_steps > 0 and warmup_steps >= 0, got {total_steps}, {warmup_steps}")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine_factor(step, total_steps, warmup_steps, min_lr_ratio)
    )


def constant(optimizer, total_steps: int, warmup_steps: STEPS = 0):
    """Constant lr after an optional linear warm-up."""
    import torch

    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0
    )


def cosine_restarts_factor(step: int, warmup_steps: int, cycle_steps: int, min_ratio: float) -> float:
    """Linear warm-up, then cosine from 1 to ``min_ratio`` over each cycle of ``cycle_steps``,
    jumping back to 1 at every cycle start (hard restarts)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = ((step - warmup_steps) % cycle_steps) / cycle_steps
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def cosine_restarts(
    optimizer,
    total_steps: int,
    cycle_steps: Annotated[int, Range(gt=0)],
    warmup_steps: STEPS = 0,
    min_lr_ratio: Annotated[float, Range(ge=0, le=1)] = 0.0,
):
    """Cosine annealing with hard restarts every ``cycle_steps`` after a linear warm-up (CLOOB,
    seed 001: cycles of 7 epochs, warm-up 20 000 steps on CC / 10 000 on YFCC)."""
    import torch

    if cycle_steps <= 0 or warmup_steps < 0:
        raise ValueError(f"need cycle_steps > 0 and warmup_steps >= 0, got {cycle_steps}, {warmup_steps}")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: cosine_restarts_factor(step, warmup_steps, cycle_steps, min_lr_ratio)
    )


def step(
    optimizer,
    total_steps: int,
    step_size: Annotated[int, Range(gt=0)],
    gamma: Annotated[float, Range(gt=0)] = 0.1,
    warmup_steps: STEPS = 0,
):
    """Multiply the lr by ``gamma`` every ``step_size`` steps after an optional linear warm-up
    (y-Aware MRI, seed 002: ×0.9 every 10 epochs)."""
    import torch

    if step_size <= 0 or not gamma > 0:
        raise ValueError(f"need step_size > 0 and gamma > 0, got {step_size}, {gamma}")

    def factor(i: int) -> float:
        warm = min(1.0, (i + 1) / warmup_steps) if warmup_steps else 1.0
        return warm * gamma ** (i // step_size)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@hookimpl
def register_optimizers(register):
    register("adamw", adamw)
    register("adam", adam)
    register("sgd", sgd)
    register("lamb", lamb)


@hookimpl
def register_schedules(register):
    register("cosine", cosine)
    register("constant", constant)
    register("cosine_restarts", cosine_restarts)
    register("step", step)
