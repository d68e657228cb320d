"""LoRA adapters on the towers (``model.lora``), through Hugging Face ``peft`` (optional extra ``[lora]``).

``add_adapters`` wraps every module of the chosen towers whose name (relative to the tower, e.g.
``transformer.blocks.3.attn.in_proj``) fully matches ``model.lora.target`` in a peft LoRA layer:
``y = W x + (alpha / rank) · B A dropout(x)`` with A [rank, in], B [out, rank] (B starts at zero,
so the adapted model starts as the base one). The towers' own weights are locked; the adapters and
the similarity's parameters (logit scale) train. A locked tower (``model.frozen``) gets no adapter.

``merge_adapters`` folds each adapter into its base weight (W <- W + (alpha / rank) · B A) and puts
the plain module back, so a merged model has exactly the keys of the model without ``model.lora``
(``clipkit export`` does this unless ``--keep-adapters``).
"""

from __future__ import annotations

import copy
import importlib.util

import torch

from clipkit.config.settings_schema import LoraConfig
from clipkit.errors import ClipkitError

#: The optional extra that brings peft.
EXTRA = "lora"
#: peft's name for the one adapter clipkit adds.
ADAPTER = "default"


def lora_config(recipe: dict) -> LoraConfig | None:
    """The typed ``model.lora`` section, or None when the recipe asks for no adapters."""
    settings = (recipe.get("model") or {}).get("lora") or {}
    return LoraConfig(**settings) if settings else None


def _peft():
    try:
        import peft
    except ImportError as error:
        from clipkit import install_hint

        try:
            installed = importlib.util.find_spec("peft") is not None
        except ValueError:  # sys.modules["peft"] is None: blocked, as good as absent
            installed = False
        cause = (
            "peft is installed but does not import — transformers, which it imports, fails when a "
            "torchvision that cannot import sits beside the CPU torch (docs/interop.md)"
            if installed
            else f"install the extra: {install_hint(EXTRA)}"
        )
        raise ClipkitError(
            f"model.lora needs the peft package ({type(error).__name__}: {error}); {cause}"
        ) from error
    return peft


def add_adapters(model: torch.nn.Module, recipe: dict, *, announce: bool = False) -> torch.nn.Module:
    """Put LoRA adapters into ``model``'s towers per ``model.lora`` (in place; returns ``model``)."""
    settings = lora_config(recipe)
    if settings is None:
        return model
    peft = _peft()
    frozen = set((recipe.get("model") or {}).get("frozen") or ())
    for name in settings.towers:
        tower = getattr(model, name, None)
        if tower is None or name in frozen:
            continue  # validation refuses a locked or missing tower; a rebuilt export may lack one
        config = peft.LoraConfig(
            r=settings.rank,
            lora_alpha=settings.alpha,
            lora_dropout=settings.dropout,
            target_modules=settings.target,
            bias="none",
        )
        try:
            peft.inject_adapter_in_model(config, tower, adapter_name=ADAPTER)
        except ValueError as error:  # peft: no module matched the pattern
            raise ClipkitError(
                f"model.lora.target: {settings.target!r} matches no adaptable module of {name} "
                f"(names are relative to the tower, e.g. 'transformer.blocks.0.attn.in_proj'; "
                f"peft says: {str(error).splitlines()[0]})"
            ) from error
        for parameter_name, parameter in tower.named_parameters():
            parameter.requires_grad_("lora_" in parameter_name)
    if announce:
        print(describe_trainable(model), flush=True)
    return model


def describe_trainable(model: torch.nn.Module) -> str:
    """One line: trainable parameters of all, and how many of them are adapters."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    adapters = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    return (
        f"model.lora: {trainable:,} trainable of {total:,} parameters ({100 * trainable / total:.2f}%), "
        f"{adapters:,} of them in adapters"
    )


def has_adapters(model: torch.nn.Module) -> bool:
    return any("lora_" in name for name, _ in model.named_parameters())


@torch.no_grad()
def merge_adapters(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with every adapter folded into its base weight and the plain modules
    back in place (the state-dict keys of the model without adapters)."""
    peft = _peft()
    from peft.tuners.lora import LoraLayer

    merged = copy.deepcopy(model)
    for name, module in list(merged.named_modules()):
        if not isinstance(module, LoraLayer):
            continue
        module.merge(adapter_names=[ADAPTER])
        parent_name, _, child = name.rpartition(".")
        parent = merged.get_submodule(parent_name) if parent_name else merged
        setattr(parent, child, module.get_base_layer())
    del peft
    return merged


def without_adapters(recipe: dict) -> dict:
    """The recipe of a merged model: ``model.lora`` removed."""
    plain = copy.deepcopy(recipe)
    plain.get("model", {}).pop("lora", None)
    return plain
