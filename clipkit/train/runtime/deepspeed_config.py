"""The DeepSpeed configuration clipkit derives from a recipe (``train.distributed``).

One source of truth: the recipe. ``accelerate launch`` only says how many processes run where;
the ZeRO stage, offload, precision, clipping and micro-batch come from here, so a run is
reproduced by its saved ``recipe.yaml`` alone. Pure: no DeepSpeed import.
"""

from __future__ import annotations

from typing import Any


def deepspeed_config(
    *,
    zero_stage: int,
    precision: str,
    micro_batch_size: int,
    micro_batches: int,
    world_size: int,
    grad_clip: float,
    offload_optimizer: str = "none",
    offload_params: str = "none",
) -> dict[str, Any]:
    """A DeepSpeed JSON config.

    micro_batch_size: samples one process encodes per forward; micro_batches: forwards per optimiser
    step (exact accumulation), so train_batch_size = micro_batch_size · micro_batches · world_size
    = the recipe's data.batch_size.

    Precision "bf16"/"fp16" is DeepSpeed's own mixed precision: parameters held in half precision
    with fp32 master weights in the optimiser, dynamic loss scaling for fp16. The loop still upcasts
    the gathered features, so similarities and losses compute in fp32.
    """
    zero: dict[str, Any] = {"stage": int(zero_stage)}
    if offload_optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if offload_params == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    if zero_stage == 3:
        # Export and evaluation gather the full weights themselves (clipkit.train.runtime.full_state_dict).
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": int(micro_batch_size),
        "gradient_accumulation_steps": int(micro_batches),
        "train_batch_size": int(micro_batch_size) * int(micro_batches) * int(world_size),
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        # Optimisers are plugins (any torch.optim.Optimizer); ZeRO partitions their param groups
        # whatever the class, but refuses classes outside its own list unless told.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,  # clipkit logs; keep DeepSpeed quiet
        "wall_clock_breakdown": False,
    }
    # Always explicit: DeepSpeed's own default clips the global norm at 1.0, which would silently
    # change a recipe that does not clip (found by tests/test_distributed.py's DDP comparison).
    config["gradient_clipping"] = float(grad_clip) if grad_clip > 0 else 0.0
    if offload_optimizer == "cpu":
        config["zero_force_ds_cpu_optimizer"] = False  # clipkit's own optimiser plugin stays in charge
    return config
