"""``train.compile``: ``torch.compile`` the towers, and with ``train.compile_scope: step`` the
similarity and the loss too.

- ``towers`` (the default, what ``train.compile`` always meant): the two encoders, in place
  (:func:`compile_towers`).
- ``step``: the towers, plus :meth:`Objective.score <clipkit.train.objective.Objective.score>` —
  the similarity and the loss on the gathered point sets, in fp32 outside autocast as always
  (METHODS §11) — as one compiled function (:func:`compile_scoring`); AOTAutograd compiles its
  backward with it. The gathers between the two (collectives), the finiteness agreement, the
  backward call and the optimiser step stay eager.

``train.compile_unit`` says how each tower is compiled: ``tower`` (whole, the default) or ``block``
(regional compilation: each repeated block — a transformer layer, a residual block — compiled and
the rest of the tower eager; identical blocks share one graph, so the cold compile traces one layer
per block shape instead of every layer).

The scoring is compiled only where it can be traced whole, which a plugin declares
(``compiles = True`` on the similarity and on the loss: plain tensor code, no generator, no custom
autograd Function, no Python value read off a tensor). Everything else falls back to eager
scoring with one printed line saying why (:func:`scoring_refusal`): a plugin that does not declare
it (WPSE draws random features from a generator; KME and WPSE's fused path are custom autograd
Functions), the tiled engine (``train.tiled``: Python loops over tiles and their own autograd), a
loss reading per-step Python numbers (``step``, ``epoch``, ``meta``: each new value would
recompile). Strategies that cannot run compiled code refuse ``train.compile`` before anything is
built (:meth:`Runtime.compile_refusal <clipkit.train.runtime.Runtime.compile_refusal>`).
Measured effect on CPU: docs/benchmarks.md ("torch.compile").
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clipkit.config.settings_schema import COMPILE_MODES, COMPILE_UNITS
from clipkit.contract.types import CONTEXT_FIELDS, optional_member
from clipkit.errors import ClipkitError


def compile_towers(
    model: Any, mode: str = "default", unit: str = "tower", *, backend: str | Callable = "inductor"
) -> Any:
    """Compile ``model``'s towers in place (``train.compile``); returns ``model``.

    ``unit``: ``"tower"`` compiles each tower whole; ``"block"`` compiles each of its blocks
    (:func:`compiled_units`) and leaves the rest (embeddings, heads, final norms) eager. Regional
    compilation: TorchDynamo treats a block's parameters as inputs, so identical blocks share one
    compiled graph and a cold compile traces one layer per block shape instead of all of them.

    Uses ``nn.Module.compile``, which swaps the module's call for the compiled one but keeps the
    module object and its parameter names, so checkpoints, exports and optimizers built before or
    after compiling see the same ``state_dict`` keys (``torch.compile(module)`` would instead wrap
    it and prefix every key with ``_orig_mod.``). Compilation itself happens lazily on the first
    forward pass (tens of seconds on a CPU), and again for each new input shape. ``backend``:
    Inductor; tests pass another TorchDynamo backend (the same traced graphs, no C++ compile).
    """
    if mode not in COMPILE_MODES:
        raise ClipkitError(f"train.compile: unknown mode {mode!r}; choose one of {', '.join(COMPILE_MODES)}")
    if unit not in COMPILE_UNITS:
        raise ClipkitError(
            f"train.compile_unit: unknown unit {unit!r}; choose one of {', '.join(COMPILE_UNITS)}"
        )
    if mode == "none":
        return model
    options = {"mode": mode} if backend == "inductor" else {"backend": backend}
    for module in compiled_units(model, unit):
        module.compile(**options)
    return model


def compiled_units(model: Any, unit: str) -> list[Any]:
    """The modules ``compile_towers`` compiles: each tower, or (``unit="block"``) each tower's
    blocks — what its encoder declares with ``sharding_blocks()``, else the members of its
    outermost ``nn.ModuleList``s (:func:`clipkit.train.runtime.wrapping.blocks`, the units FSDP2
    shards). A tower without blocks is compiled whole."""
    from clipkit.train.runtime.wrapping import blocks, towers

    chosen: list[Any] = []
    for tower in towers(model):
        parts = blocks(tower) if unit == "block" else []
        chosen += parts or [tower]
    return chosen


#: LossContext fields a compiled scoring can take: tensors and point sets. The others are Python
#: values that change every step (``step``, ``epoch``; ``meta`` holds lists), on which a compiled
#: graph would be specialised and recompiled.
TRACEABLE_FIELDS = frozenset({"index", "features", "in_modal"})


def scoring_refusal(objective: Any) -> str | None:
    """Why ``objective``'s similarity + loss cannot run compiled (None when they can)."""
    similarity, loss = objective.similarity, objective.loss
    if objective.tile_size is not None:
        return "the loss runs tiled (train.tiled): the tile engine's loops and autograd stay eager"
    if getattr(objective, "distill", None) is not None:
        return "train.distill adds the teacher's terms to the logits outside the compiled function"
    for kind, plugin in (("similarity", similarity), ("loss", loss)):
        if not optional_member(plugin, "compiles"):
            return f"the {kind} {type(plugin).__name__} does not declare `compiles`"
    if optional_member(similarity, "uses_random_features"):
        return f"the similarity {type(similarity).__name__} draws random features from a generator"
    per_step = sorted((objective.requires & CONTEXT_FIELDS) - TRACEABLE_FIELDS)
    if per_step:
        return f"the loss {type(loss).__name__} reads {', '.join(per_step)}, which would recompile every step"
    return None


def compile_scoring(
    objective: Any, mode: str = "default", *, backend: str = "inductor"
) -> Callable[..., Any]:
    """``objective.score`` as one compiled function of (local_a, local_b, a, b, gathered, targets)
    -> LossOutput (:meth:`clipkit.train.objective.Objective.score`). Call only where
    :func:`scoring_refusal` is None: the similarity gets no generator and the loss no step or epoch.
    ``backend``: Inductor (generated kernels); tests use "aot_eager" (the same traced forward and
    backward graphs, run by eager kernels: seconds instead of a C++ compile)."""
    import torch

    if mode not in COMPILE_MODES or mode == "none":
        raise ClipkitError(f"train.compile: cannot compile the scoring in mode {mode!r}")
    local = objective.runtime.local_loss  # fixed for the run: a constant of the graph

    def no_generator() -> None:
        return None

    def scoring(local_a, local_b, a, b, gathered: dict, targets):
        return objective.score(local_a, local_b, a, b, gathered, targets, local, 0, 0.0, no_generator)

    if backend != "inductor":
        return torch.compile(scoring, backend=backend)
    return torch.compile(scoring, mode=mode)


def compile_unavailable() -> str | None:
    """Why ``torch.compile`` cannot run here (None when it can): TorchDynamo must support this
    Python, and Inductor's CPU backend needs a C++ compiler (``$CXX`` or g++ / c++ / clang++)."""
    import torch

    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        return f"TorchDynamo does not support Python {sys.version.split()[0]} on {sys.platform}"
    compilers = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    if not any(shutil.which(compiler) for compiler in compilers):
        return f"no C++ compiler found ({', '.join(compilers)}); Inductor's CPU backend needs one"
    return None


def is_compiled(module: Any) -> bool:
    """Whether ``nn.Module.compile`` has been applied to ``module``."""
    return getattr(module, "_compiled_call_impl", None) is not None


@dataclass(frozen=True)
class GraphBreaks:
    """What TorchDynamo made of one forward: ``graphs`` traced, one line per ``breaks`` (the reason
    and where), which each cost a return to Python and split what Inductor can fuse."""

    graphs: int
    breaks: list[str]


def graph_breaks(module: Any, *inputs: Any) -> GraphBreaks:
    """Trace ``module(*inputs)`` with ``torch._dynamo.explain`` — no compilation, so it runs on the
    CPU in seconds for tiny towers — and list the graph breaks ``train.compile`` would meet."""
    import torch._dynamo

    torch._dynamo.reset()  # an earlier trace's cache must not hide this one's breaks
    try:
        explanation = torch._dynamo.explain(module)(*inputs)
    finally:
        torch._dynamo.reset()
    breaks = []
    for reason in explanation.break_reasons:
        frame = reason.user_stack[-1] if reason.user_stack else None
        where = f" ({frame.filename}:{frame.lineno})" if frame is not None else ""
        breaks.append(f"{reason.reason.strip().splitlines()[0]}{where}")
    return GraphBreaks(explanation.graph_count, breaks)


def scoring_graph_breaks(objective: Any, a: Any, b: Any, gathered: dict | None = None) -> GraphBreaks:
    """:func:`graph_breaks` of the scoring ``train.compile_scope: step`` compiles — the similarity
    and the loss on the point sets ``a``, ``b`` [N, M, d] as the whole batch (``gathered``: the
    index/meta a loss declares) — so a plugin's ``compiles`` can be checked, not trusted."""
    import torch

    local = objective.runtime.local_loss

    def scoring(a, b, gathered, targets):
        return objective.score(a, b, a, b, gathered, targets, local, 0, 0.0, lambda: None)

    targets = torch.arange(a.batch_size, device=a.points.device)
    return graph_breaks(scoring, a, b, gathered or {}, targets)
