"""Every hook a clipkit plugin can implement.

A plugin is a module (or object) with functions decorated by :data:`hookimpl` and named
like the specs below. Built-in plugins (``clipkit.plugins.*``) use the same hooks as
third-party packages, which declare themselves under the ``clipkit`` entry-point group::

    [project.entry-points.clipkit]
    my_plugin = "my_package.plugin"

Registration hooks receive a ``register(name, factory)`` callback. The host owns
validation: a name registered twice is an error naming both plugins, and recipes refer
to plugins only by these names. Keep module import light (import torch inside the hook
or the factory) so ``clipkit --help`` stays fast.
"""

from __future__ import annotations

import pluggy

PROJECT = "clipkit"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_encoders(register):
    """Register encoder factories: ``register(name, factory)``.

    ``factory(**recipe_kwargs) -> nn.Module`` whose ``forward`` returns a
    :class:`clipkit.contract.types.PointSet`. The host also passes, when the factory's signature
    names them: ``embed_dim`` (model.embed_dim), ``image_size`` (image encoders),
    ``vocab_size`` and ``context_length`` (text encoders, from the tokenizer).

    A text tower whose weights index one vocabulary declares it on the factory:
    ``factory.required_tokenizer = {"name": "wordpiece", "vocab": "minilm"}`` (the tokenizer
    slot's name and the arguments that must match); ``clipkit validate`` and ``train`` then refuse
    any other ``model.tokenizer`` before building, naming the override that fixes it.
    """


@hookspec
def register_tokenizers(register):
    """Register tokenizer factories: ``factory(**kwargs) -> Tokenizer`` (texts -> [B, L] ids)."""


@hookspec
def register_similarities(register):
    """Register similarity factories: ``factory(**kwargs) -> nn.Module`` implementing
    :class:`clipkit.contract.types.Similarity`. Learnable parameters (temperature, bandwidth) live in
    the module; ``embed_dim`` is passed when the signature names it."""


@hookspec
def register_losses(register):
    """Register loss factories: ``factory(**kwargs) -> Loss`` (a callable with ``requires``).

    The host passes ``num_samples`` (dataset size n from the shard manifest),
    ``total_steps`` (``train.steps``) and ``batch_size`` (``data.batch_size``, the global batch)
    when the signature names them, for per-sample state and schedules inside the loss
    (SogCLR, NUCLR's epoch-based ζ schedule). A loss holding state is an
    ``nn.Module`` whose buffers are saved in checkpoints.
    """


@hookspec
def register_distill_losses(register):
    """Register distillation losses: ``factory(**kwargs) -> DistillLoss``, a callable
    ``(student, teacher) -> LossOutput`` over two :class:`clipkit.contract.types.DistillView`
    (similarity logits and the anchors' image and text embeddings). A recipe lists them in
    ``train.distill.losses`` (``[{name, weight, ...kwargs}]``); the host adds ``weight ×`` each loss
    to the contrastive loss (docs/distillation.md). A loss comparing embeddings one to one declares
    ``compares_features = True`` (the host then requires equal student and teacher widths).
    """


@hookspec
def register_optimizers(register):
    """Register optimizer factories: ``factory(named_parameters, **kwargs) -> torch.optim.Optimizer``.

    ``named_parameters`` is a list of ``(name, parameter)`` so the factory builds its own
    parameter groups (e.g. no weight decay on gains, biases and temperatures).
    """


@hookspec
def register_schedules(register):
    """Register learning-rate schedule factories:
    ``factory(optimizer, total_steps, **kwargs) -> torch.optim.lr_scheduler.LRScheduler``."""


@hookspec
def register_evals(register):
    """Register evaluation tasks: ``factory(**kwargs) -> task``; ``task(model, registry) -> dict``.

    ``model`` is a :class:`clipkit.model.ContrastiveModel` loaded from an export (or the
    in-memory export during training); the returned dict is JSON-serialisable and has a
    ``"table"`` list of ``{metric: value}`` rows for printing.
    """


@hookspec
def register_streams(register):
    """Register batch streams for data that is generated, not stored (synthetic studies):
    ``factory(batch_size, seed, rank, world_size, **recipe keys) -> stream`` for a recipe's
    ``data.stream: {name: ..., ...}``, used instead of shards.

    A stream is an iterator of batch dicts (tensors of this process's ``batch_size`` rows and an
    ``index`` [B] long tensor of sample ids) with ``num_samples`` (the epoch size ids are taken
    modulo), ``epoch`` and ``batch_in_epoch`` attributes, and ``position() -> dict`` (with integer
    ``epoch`` and ``batch_in_epoch``) / ``restore(position)`` for exact resume. It must yield the
    same batches after ``restore``.
    """


@hookspec
def register_recipes(register):
    """Register recipes: ``register(name, factory)`` with ``factory() -> dict`` (the YAML's
    content). Plugin packages can ship paper recipes this way."""


@hookspec
def register_commands(app):
    """Add Typer sub-commands to the ``clipkit`` application ``app``."""


@hookspec(firstresult=True)
def open_source(uri, options):
    """Open a data source for ``clipkit shard`` and evaluation, or return None if ``uri`` is
    not yours. The first non-None result wins; built-in sources are ``trylast`` so plugins
    can take over any scheme.

    uri:     e.g. ``synthetic://shapes?n=4096`` or a path.
    options: dict of extra options (from the CLI or recipe).
    Returns an iterable of :class:`clipkit.contract.types.Sample` with an ``info() -> dict`` method.
    """


@hookspec(firstresult=True)
def read_model(path, registry, options):
    """Read a model stored in a layout other than a clipkit export (open_clip, Hugging Face, ...):
    return ``(model, metadata)`` — a :class:`clipkit.model.ContrastiveModel` in eval mode and
    export-style metadata (``recipe``, ``plugins``) — or None if ``path`` is not yours. Built-ins
    are ``trylast``. ``options``: reader options (e.g. ``quick_gelu`` for a bare state dict).
    Used by ``clipkit eval``, ``clipkit.load``, ``model.init`` and ``clipkit convert``."""


@hookspec(firstresult=True)
def convert_model(source, out, layout, registry, options):
    """Write the model at ``source`` (an export or any layout a ``read_model`` plugin reads) in
    ``layout`` at ``out`` and return the written path, or None if ``layout`` is not yours
    (``clipkit convert --to LAYOUT``). Built-ins are ``trylast``."""


@hookspec
def on_metrics(step, metrics, run):
    """Receive a metrics dict (JSON-serialisable floats) at optimiser step ``step``.

    ``run`` is a :class:`clipkit.train.build.RunInfo` (run directory, recipe name, whether
    this process is the main one). Called on every process; loggers usually write only
    when ``run.is_main``.
    """


@hookspec
def on_run_start(run, recipe, start_step):
    """A training run starts (or resumes): called once on the main process, before the first step.

    ``run`` is the :class:`clipkit.train.loop.RunInfo` later passed to ``on_metrics``; ``recipe`` the
    resolved recipe (a plain dict, as saved in ``RUN/recipe.yaml``); ``start_step`` the step the
    loop continues from (0 for a new run). Experiment trackers open their run here and store the
    recipe as its configuration; raise :class:`clipkit.errors.ClipkitError` to refuse to start.
    """


@hookspec
def on_evals(step, results, run):
    """The recipe's eval tasks ran on the export at the end of training (main process only).

    ``results`` is the list ``RUN/eval.json`` holds (one dict per task, with a ``"table"`` of
    ``{metric: value}`` rows; :func:`clipkit.eval.report.metric_rows` flattens one); ``step`` is the
    last training step. Evaluations during training (``train.eval_every``) arrive through
    ``on_metrics`` instead, as ``eval/<task>/<metric>`` keys.
    """


@hookspec
def on_run_end(run, status):
    """The run ended (main process only), after the export and its evaluation.

    ``status``: ``"finished"``, ``"stopped"`` (a SIGTERM/SIGINT graceful stop, see
    :mod:`clipkit.train.stop`; a checkpoint was written) or ``"failed"`` (an exception propagates).
    """
