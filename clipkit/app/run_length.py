"""How long a run on your own data is: ``clipkit train RECIPE --data TABLE [--epochs E]``.

A step count means nothing to someone who brings a table: 20 steps of 64 are 0.45 of an epoch of
3 000 images, and a model that has not seen its data once scores at chance. So with ``--data``:

- the tiny variants (``@tiny``, ``quickstart``) train for a compute budget: a fixed number of
  image–caption pairs (:data:`clipkit.app.own_data_defaults.BUDGET_SAMPLES`, at most
  :data:`~clipkit.app.own_data_defaults.MAX_EPOCHS` passes over a small table), said in epochs of
  the training split of the table (what is left after the held-out part) — ten epochs of a few
  thousand drawings were a tenth of a ten-minute budget and left most of the quality unused; they
  also take the rest of :mod:`clipkit.app.own_data_defaults` (a pretrained text tower when installed,
  mild crops, a warm-up sized to the run);
- ``--epochs E`` asks for E epochs on any recipe (not capped); ``train.steps=N`` still wins;
- the start of the run prints ``N steps = E epochs of your M samples`` (:func:`plan_line`), and a
  run that ends under one epoch says so in its last line and in its report (:func:`short_run_note`).

The table is sharded here, before training, since its sample count is what the steps follow (the
run then finds the shards made).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from clipkit.errors import ClipkitError


@dataclass(frozen=True)
class RunLength:
    """``steps`` of ``batch_size`` over ``num_samples`` training samples."""

    steps: int
    batch_size: int
    num_samples: int

    @property
    def epochs(self) -> float:
        return self.steps * self.batch_size / self.num_samples


def sized_by_epochs(spec: str) -> bool:
    """Whether recipe ``spec`` sizes an own-data run by epochs by default: the tiny variants."""
    from clipkit.config.recipe import split_spec

    name, variant = split_spec(spec)
    return name == "quickstart" or "tiny" in (variant or "").split("+")


def sets_steps(overrides: list[str]) -> bool:
    """Whether the user's ``key=value`` overrides set ``train.steps`` themselves."""
    return any(re.match(r"^\+?train\.steps=", item.strip()) for item in overrides)


def steps_for(epochs: float, num_samples: int, batch_size: int, cap: int | None = None) -> int:
    """The steps of ``batch_size`` that make ``epochs`` passes over ``num_samples`` (at least 1,
    at most ``cap``)."""
    if not epochs > 0:
        raise ClipkitError(f"--epochs must be > 0, got {epochs}")
    steps = max(1, math.ceil(epochs * num_samples / batch_size))
    return min(steps, cap) if cap else steps


def training_batch(recipe: dict, num_samples: int) -> int:
    """The global batch a run of ``recipe`` uses on ``num_samples`` training samples (one process):
    ``data.batch_size``, lowered to the split by ``data.fit_batch`` when it holds less."""
    from clipkit.config.recipe import section

    data = section(recipe, "data")
    batch = int(data.batch_size)
    return min(batch, num_samples) if data.fit_batch and num_samples >= 2 else batch


def count_training_samples(recipe: dict, registry) -> int | None:
    """The samples training sees of ``recipe``'s data: its shards (made from ``data.source`` now,
    when missing) less the held-out split, or those of a streamed set (:func:`streamed_samples`).
    None under several processes when the shards are not
    made yet: every process runs this before any can wait for another, so none may shard here
    (process 0 shards during training, as without ``--data``)."""
    from clipkit.config.recipe import section
    from clipkit.data.loader import training_split
    from clipkit.data.shard import MANIFEST
    from clipkit.data.shard_writer import ensure_shards
    from clipkit.train.build import check_data_location, is_streamed_data, shard_target

    data = section(recipe, "data")
    check_data_location(recipe, registry)  # the same refusals as training's, before anything is written
    if is_streamed_data(data):
        return streamed_samples(data)
    target = shard_target(data)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not (Path(target) / MANIFEST).is_file():
        return None
    shards = ensure_shards(target, data.source, pm=registry.pm)
    from clipkit.app.own_data import recipe_holdout

    return training_split(shards, recipe_holdout(data)).num_samples


def streamed_samples(data) -> int:
    """The samples of an epoch of shards read in place (a folder of tars without a manifest, URLs,
    a mixture; never held out): sized as the loader sizes it, by ``data.num_samples`` or else the
    counts of a ``manifest.json`` / ``sizes.json`` beside the shards; a DataError naming the shards
    and ``data.num_samples`` when neither is there. Nothing is sharded: there is no source."""
    from clipkit.data.mixture import stream_sources
    from clipkit.data.remote import Patience

    patience = Patience(timeout=data.timeout, retries=data.retries)
    return stream_sources(data.shards, data.mixture, data.num_samples, patience)[1]


def plan(
    recipe: dict, registry, *, epochs: float | None, by_default: bool, max_epochs: int | None = None
) -> RunLength | None:
    """The run's length on its data: ``epochs`` when given, the compute budget
    (:func:`clipkit.app.own_data_defaults.budget_steps`, at most ``max_epochs`` passes when given)
    when ``by_default``, else the recipe's ``train.steps``; None when the data cannot be counted
    before training (:func:`count_training_samples`)."""
    from clipkit.app.own_data_defaults import MAX_EPOCHS, budget_steps
    from clipkit.config.recipe import section

    num_samples = count_training_samples(recipe, registry)
    if num_samples is None:
        return None
    if num_samples < 1:
        raise ClipkitError("--data: no sample is left to train on after the held-out split")
    batch = training_batch(recipe, num_samples)
    if epochs is not None:
        steps = steps_for(epochs, num_samples, batch)
    elif by_default:
        steps = budget_steps(num_samples, batch, max_epochs or MAX_EPOCHS)
    else:
        steps = int(section(recipe, "train").steps)
    return RunLength(steps, batch, num_samples)


def plan_line(length: RunLength) -> str:
    """``train: 470 steps = 10 epochs of your 2 993 samples (batch 64)``, with how to change it."""
    text = (
        f"train: {length.steps} steps = {length.epochs:.3g} epochs of your {length.num_samples} samples "
        f"(batch {length.batch_size}); --epochs E or train.steps=N to change it"
    )
    if length.epochs < 1:
        text += " — under one epoch: the model will not see all its data once"
    return text


#: What the start of a run says when it cannot be sized by epochs (several processes, a table).
UNSIZED_NOTE = (
    "train: {steps} steps (the recipe's): under several processes a table is sharded during training, "
    "so its run is not sized by epochs; shard it first (clipkit shard TABLE DIR) and pass --data DIR"
)


def short_run_note(metrics: dict) -> str | None:
    """The note a run that ended under one epoch gets (its last line and its report), else None."""
    epoch = metrics.get("epoch")
    if not isinstance(epoch, float) or epoch >= 1:
        return None
    return (
        f"this run ended after {epoch:.2f} of an epoch: the model did not see all its training data "
        "once, so its scores say little; train longer with --epochs E (with --data) or train.steps=N"
    )


def size_run(spec: str, recipe: dict, user_overrides: list[str], epochs: float | None, registry):
    """(``recipe`` sized and set for the user's data, the lines to print: what the tiny variant's
    defaults chose (:mod:`clipkit.app.own_data_defaults`) and ``N steps = E epochs of your M samples``).
    The table is sharded now (its sample count sets the steps); the user's own ``train.steps=N``
    and other overrides are kept as given."""
    from clipkit.app import own_data_defaults as defaults
    from clipkit.config.recipe import amend_resolved, section, validate_or_raise

    user_steps, tiny = sets_steps(user_overrides), sized_by_epochs(spec)
    extra, notes, images = [], [], []
    if tiny:
        towers, note = defaults.tower_overrides(recipe, user_overrides)
        images, image_note = defaults.image_tower_overrides(recipe, user_overrides)
        towers, space_note = defaults.sentence_space_overrides(towers, images, user_overrides)
        # A locked pretrained image tower sees uncropped images (its features are then cached).
        extra += towers + (images or defaults.augment_overrides(recipe, user_overrides))
        notes += [line for line in (space_note or note, image_note) if line]
    # With the pretrained image tower only projections train on fixed features: fewer passes.
    max_epochs = defaults.PRETRAINED_IMAGE_EPOCHS if images else None
    by_default = tiny and not user_steps
    length = plan(
        recipe, registry, epochs=None if user_steps else epochs, by_default=by_default, max_epochs=max_epochs
    )
    steps = length.steps if length is not None else int(section(recipe, "train").steps)
    if length is not None and not user_steps:
        extra.append(f"train.steps={length.steps}")
    if tiny:
        extra += defaults.warmup_overrides(recipe, steps, user_overrides)
    if extra:
        recipe = amend_resolved(recipe, extra, kept=user_overrides, where=spec)
        recipe = validate_or_raise(recipe, registry, where=spec)
    line = UNSIZED_NOTE.format(steps=steps) if length is None else plan_line(length)
    return recipe, "\n".join([*notes, line])
