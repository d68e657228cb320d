"""``train.compile``: ``torch.compile`` the two towers of a model, and nothing else.

Only the encoders are compiled. The similarity and the loss stay eager because they run in
fp32 outside autocast (METHODS §11: exp(Δ/τ) overflows in fp16), some of them draw fresh random
features from a generator every step (WPSE) and some use custom autograd Functions; they are
also a small share of the step. Measured effect on CPU: docs/benchmarks.md ("torch.compile").
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from typing import Any

from clipkit.config.settings_schema import COMPILE_MODES
from clipkit.errors import ClipkitError

#: The model attributes holding the towers (``text_encoder`` is None for two-view models).
TOWERS = ("image_encoder", "text_encoder")


def compile_towers(model: Any, mode: str = "default") -> Any:
    """Compile ``model.image_encoder`` and ``model.text_encoder`` in place; returns ``model``.

    Uses ``nn.Module.compile``, which swaps the module's call for the compiled one but keeps the
    module object and its parameter names, so checkpoints, exports and optimizers built before or
    after compiling see the same ``state_dict`` keys (``torch.compile(module)`` would instead wrap
    it and prefix every key with ``_orig_mod.``). Compilation itself happens lazily on the first
    forward pass (tens of seconds on a CPU), and again for each new input shape.
    """
    if mode not in COMPILE_MODES:
        raise ClipkitError(f"train.compile: unknown mode {mode!r}; choose one of {', '.join(COMPILE_MODES)}")
    if mode == "none":
        return model
    for name in TOWERS:
        tower = getattr(model, name, None)
        if tower is not None:
            tower.compile(mode=mode)
    return model


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
