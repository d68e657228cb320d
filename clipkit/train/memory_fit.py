"""Will the run fit in memory? An estimate before training starts, against what the machine has.

A run too large for its machine used to be killed by the kernel after minutes with no message.
:func:`check_memory` runs after the model is built and before the data, optimiser and runtime
are: it estimates the bytes one training process holds at its peak, compares them with what this
process may still use, and refuses (exit 2) or warns, naming the knobs that lower the figure.

The estimate, per process (``B``: the samples the towers encode at once — ``train.micro_batch_size``
or the process's share of ``data.batch_size``; ``G``: the global batch the loss scores)::

    weights + buffers                 as allocated (bytes of every parameter and buffer) x s_w
  + gradients                         4 bytes x trainable parameters (fp32) x s_g
  + optimiser state                   k x 4 bytes x trainable parameters (k = 2 for Adam(W), 1 SGD) x s_o
  + optimiser step                    4 bytes x trainable parameters (foreach temporaries) x s_o
  + DDP buckets                       4 bytes x trainable parameters (DDP with several processes only)
  + weight EMA                        4 bytes x trainable parameters (train.ema; never sharded)
  + gathered blocks                   2 x the largest FSDP2 unit's parameters in the compute precision
                                      (FSDP2 and ZeRO-3: the unit running and the one prefetched)
  + activations                       A(1) + (A(2) - A(1)) x (B - 1), measured (below)
  + logits                            24 bytes x rows x G (i2t and t2i, their softmax, gradients;
                                      rows = B with train.distributed.local_loss, else G);
                                      tiled (train.tiled): 24 bytes x tile² + 64 bytes x G
  + batches in flight (host RAM)      (2 x workers + 2) x the bytes of one input batch
  + runtime (host RAM)                this process's resident memory now, less the weights

The sharing factors ``s_w, s_g, s_o`` are 1, or 1/W where the strategy shards that term over the
``W`` processes (:func:`clipkit.train.runtime.sharding.shares`): FSDP2 shards all three, ZeRO-1 the
optimiser, ZeRO-2 also the gradients, ZeRO-3 also the weights.

``A(b)``: the bytes of the tensors autograd saves for backward during a forward of the towers on a
``b``-sample batch of random inputs, counted by ``torch.autograd.graph.saved_tensors_hooks`` (each
storage once, parameters excluded), in train mode, under the recipe's precision (autocast) and
``train.grad_checkpointing`` — the encoders' real activation memory, whatever their architecture,
for two small forwards. Not counted: the allocator's caching and fragmentation, the transient
buffers of backward (about one layer's activation), a similarity's own intermediates beyond the
logits (KME/WPSE point sets), per-sample loss state (SogCLR/NUCLR: O(n) floats), DeepSpeed's own buffers and
FSDP2's padding of uneven shards.

Accuracy, measured on CPU (``nuclr`` with a ResNet-50 at 256 px, fp32, no workers: peak RSS from
``/usr/bin/time -v``): batch 8 estimated 3.2 GiB, peak 3.2 GiB; batch 32 estimated 6.0 GiB, peak
5.8 GiB — within about 5 % of the real peak, the per-sample activation slope within 5 %; GPUs, other
encoders and allocators may differ more (say 25 %). A run is refused when the estimate exceeds what
is available (``train.memory_check=false`` runs it anyway) and warned about above
:data:`WARN_FRACTION` of it.

Available: on CUDA, ``torch.cuda.mem_get_info`` of this process's device for the weights,
gradients, optimiser, activations and logits (the batches in flight are host RAM); on the CPU,
``MemAvailable`` of ``/proc/meminfo`` (else psutil), lowered to a cgroup v2 limit's headroom
(``memory.max - memory.current``, a container's share) and divided among the training processes
of the node (``LOCAL_WORLD_SIZE``), plus what this process holds already (its weights and runtime
are in the estimate). Where none of these can be read the check is skipped.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from clipkit.errors import ClipkitError

log = logging.getLogger("clipkit.train")

#: Warn when the estimate is above this fraction of the available memory.
WARN_FRACTION = 0.8
#: Optimiser state per trainable parameter, in fp32 copies (unknown optimisers count as Adam).
OPTIMIZER_STATE = {"adamw": 2, "adam": 2, "lamb": 2, "sgd": 1, "lion": 1}
#: Logits, their softmax and their gradients in both directions: 6 fp32 numbers per pair.
LOGIT_BYTES = 24
KNOBS = (
    "data.batch_size (a smaller batch), train.micro_batch_size (encode the batch in pieces), "
    "train.grad_checkpointing=true, train.precision=bf16 (or fp16), data.num_workers (fewer batches "
    "in flight), model.frozen (no gradients or optimiser state for a locked tower), "
    "train.distributed.strategy=fsdp2 with several processes (each holds 1/W of weights, gradients "
    "and optimiser state)"
)


class NotEnoughMemoryError(ClipkitError):
    """The run's memory estimate exceeds what the machine has."""


@dataclass(frozen=True)
class Estimate:
    """Bytes one training process needs at its peak, by part."""

    parts: dict[str, int]
    device: str  # "cuda" or "cpu": where the weights, activations and logits live
    host_parts: tuple[str, ...] = ("batches in flight", "runtime")

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def on_device(self) -> int:
        return sum(v for k, v in self.parts.items() if k not in self.host_parts)

    def describe(self) -> str:
        listed = ", ".join(f"{name} {gib(value)}" for name, value in self.parts.items() if value)
        return f"{gib(self.total)} ({listed})"


def gib(count: float) -> str:
    return f"{count / 2**30:.2f} GiB"


# ----------------------------------------------------------------------------- the estimate


def saved_activation_bytes(model, batch: dict, autocast) -> int:
    """Bytes autograd keeps for backward during ``model(batch)`` (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    total = 0

    def pack(tensor: torch.Tensor):
        nonlocal total
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in params and key not in seen:
            seen.add(key)
            total += storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), autocast:
        model(batch)
    return total


def random_batch(model, batch_size: int, image_size: int) -> dict | None:
    """A batch of random inputs for the towers (None for ``pair: vectors``: sizes unknown here)."""
    generator = torch.Generator().manual_seed(0)
    images = lambda: torch.rand(batch_size, 3, image_size, image_size, generator=generator)  # noqa: E731
    if model.pair == "two_view":
        return {"image": images(), "image2": images()}
    if model.pair == "image_text":
        tokens = torch.as_tensor(model.tokenizer(["a photo of a thing"] * batch_size))
        return {"image": images(), "text": tokens}
    return None


def activation_bytes(model, per_forward: int, image_size: int, precision: str) -> int:
    """A(B) = A(1) + (A(2) - A(1)) (B - 1), each A measured by :func:`saved_activation_bytes`
    (the measurement leaves no trace: see :func:`leaving_no_trace`)."""
    one, two = random_batch(model, 1, image_size), random_batch(model, 2, image_size)
    if one is None or two is None:
        return 0
    half = precision in ("bf16", "fp16")

    def measure(batch):
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=half)
        return saved_activation_bytes(model, batch, autocast)

    with leaving_no_trace(model):
        model.train()
        a1, a2 = measure(one), measure(two)
    return max(a1, a1 + (a2 - a1) * (per_forward - 1))


@contextlib.contextmanager
def leaving_no_trace(model) -> Iterator[None]:
    """Run measurement forwards without changing what training will do: the RNG streams (dropout),
    the buffers (BatchNorm statistics), frozen towers' output caches, train/eval mode and grads."""
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    caches = [(m.output_cache, dict(m.output_cache.store), m.output_cache.computed)
              for m in model.modules() if hasattr(m, "output_cache")]  # fmt: skip
    modes = [(m, m.training) for m in model.modules()]
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for cache, store, computed in caches:
            cache.store, cache.computed = store, computed
        for module, training in modes:
            module.training = training
        model.zero_grad(set_to_none=True)


def input_batch_bytes(model, batch_size: int, image_size: int) -> int:
    """One collated batch: float32 images (two views for two_view) and int64 tokens."""
    images = batch_size * 3 * image_size * image_size * 4 * (2 if model.pair == "two_view" else 1)
    tokens = batch_size * 8 * int(getattr(model.tokenizer, "context_length", 0) or 0)
    return images + tokens


def estimate_memory(
    recipe: dict,
    model,
    plan,
    *,
    world_size: int,
    device: str,
    workers: int,
    tiling_refusal: str | None = None,
) -> Estimate:
    """The estimate of the module docs for a built (not yet trained) model and batch ``plan``;
    ``tiling_refusal``: why the recipe cannot run tiled (clipkit.tiled.settings.recipe_refusal)."""
    from clipkit.config.recipe import distributed_config, section
    from clipkit.tiled import settings as tiled_settings
    from clipkit.train.runtime.sharding import largest_unit_bytes, shares

    settings, model_section = section(recipe, "train"), section(recipe, "model")
    share = shares(distributed_config(recipe), world_size)
    full_weights = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    weights = full_weights * share.weights + buffers
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad) * 4
    compute_bytes = 2 if settings.precision in ("bf16", "fp16") else 4
    optimizer = str((recipe.get("optimizer") or {}).get("name", "adamw")).lower()
    per_forward = plan.micro_size if plan.micro_batches > 1 else plan.local_size
    rows = plan.local_size if distributed_config(recipe).local_loss else plan.global_size
    parts = {
        "weights": int(weights),
        "gradients": int(trainable * share.gradients),
        "optimiser state": int(OPTIMIZER_STATE.get(optimizer, 2) * trainable * share.optimizer),
        "optimiser step": int(trainable * share.optimizer),
        "DDP buckets": trainable if share.buckets else 0,
        "weight EMA": trainable if settings.ema else 0,  # fp32, whole on every process (clipkit.train.ema)
        "gathered blocks": 2 * largest_unit_bytes(model, compute_bytes) if share.gathers else 0,
        "activations": activation_bytes(model, per_forward, model_section.image_size, settings.precision),
        "logits": tiled_settings.logit_bytes(recipe, rows, plan.global_size, LOGIT_BYTES, tiling_refusal),
        "batches in flight": (2 * workers + 2)
        * input_batch_bytes(model, plan.local_size, model_section.image_size),
        # the whole weights are in RAM until moved (and sharded)
        "runtime": max(0, (resident_bytes() or 0) - full_weights - buffers),
    }
    return Estimate(parts, device)


# ----------------------------------------------------------------------------- what is available


def available_ram() -> int | None:
    """Bytes of RAM this process may still take: MemAvailable (or psutil), lowered to a cgroup v2
    limit's headroom; None when unknown."""
    found = _meminfo_available()
    if found is None:
        try:
            import psutil

            found = int(psutil.virtual_memory().available)
        except Exception:  # not installed, or no such figure on this platform
            found = None
    limit = _cgroup_headroom()
    if limit is not None:
        found = limit if found is None else min(found, limit)
    return found


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_headroom() -> int | None:
    base = Path("/sys/fs/cgroup")
    try:
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((base / "memory.current").read_text().strip()))
    except (OSError, ValueError):
        return None


def resident_bytes() -> int | None:
    """This process's resident memory (VmRSS), None where /proc is not there."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_gpu(device) -> int | None:
    try:
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    except Exception:  # no CUDA, or the device cannot be queried
        return None


# ----------------------------------------------------------------------------- the check


def check_memory(
    recipe: dict, model, runtime, *, workers: int, announce: bool, registry=None
) -> Estimate | None:
    """Refuse (:class:`NotEnoughMemoryError`, exit 2) a run whose estimate exceeds the memory available to
    it, warn above :data:`WARN_FRACTION` of it; ``train.memory_check=false`` skips the check.
    ``registry``: to tell whether the recipe's plugins can tile (without it, they are assumed to)."""
    from clipkit.config.machine import processes_on_node
    from clipkit.config.recipe import section

    if not section(recipe, "train").memory_check:
        return None
    device = runtime.device.type
    from clipkit.tiled.settings import plugin_refusal, strategy_refusal

    distributed = (recipe.get("train") or {}).get("distributed")
    plugins = None if registry is None else plugin_refusal(recipe, registry)
    refusal = plugins or strategy_refusal(distributed)
    estimate = estimate_memory(
        recipe,
        model,
        runtime.plan,
        world_size=runtime.world_size,
        device=device,
        workers=workers,
        tiling_refusal=refusal,
    )
    budgets = []  # (what is compared, bytes needed, bytes available, where)
    if device == "cuda":
        budgets.append((estimate.on_device, available_gpu(runtime.device), f"free on {runtime.device}"))
        ram = available_ram()  # the host holds the batches in flight (its runtime is held already)
        host = None if ram is None else ram // processes_on_node()
        budgets.append((estimate.parts["batches in flight"], host, "of RAM available"))
    else:
        ram, held = available_ram(), resident_bytes() or 0
        share = processes_on_node()
        where = "of RAM available" + (f" to each of {share} processes" if share > 1 else "")
        budgets.append((estimate.total, None if ram is None else ram // share + held, where))
    for needed, available, where in budgets:
        if available is None:
            log.debug("memory check: cannot tell the memory %s; skipped", where)
            continue
        if needed > available:
            raise NotEnoughMemoryError(
                f"train: this run needs about {estimate.describe()} per process, but only "
                f"{gib(available)} {where}: it would be killed for lack of memory; lower it with "
                f"{KNOBS}, or set train.memory_check=false to try anyway (docs/recipes.md)"
            )
        if needed > WARN_FRACTION * available and announce:
            print(
                f"warning: this run needs about {estimate.describe()}, close to the {gib(available)} "
                f"{where}; if it is killed, lower it with {KNOBS}",
                flush=True,
            )
    if announce:
        log.info("memory estimate: %s", estimate.describe())
    return estimate
