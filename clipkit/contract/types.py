"""Types that cross plugin boundaries.

Every encoder returns a :class:`PointSet`; every similarity maps two point sets to
:class:`Logits`; every loss maps logits (plus the :class:`LossContext` fields it
declares in ``requires``) to a :class:`LossOutput`. Plain CLIP is the case M == 1.

Shapes use B (batch), M (points per input), d (embedding width), Na/Nb (anchors,
candidates). Torch is imported lazily by the modules that build tensors; this
module only needs it for type annotations.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch import Tensor


#: Values of :attr:`PointSet.weight_normalization`.
WEIGHT_NORMALIZATIONS = ("sum", "count")


class PointSetError(ValueError):
    """A :class:`PointSet` built from tensors of the wrong shape (or an unknown weight normalization).

    A ``ValueError`` (what a plugin's own tests may catch), of its own class so the host can tell it
    from any other ``ValueError`` raised inside a tower and name the slot that built it
    (:meth:`clipkit.model.ContrastiveModel.run_tower`)."""


class _PointSetFields(NamedTuple):
    points: Tensor
    weights: Tensor | None = None
    mask: Tensor | None = None
    weight_normalization: str = "sum"


class PointSet(_PointSetFields):
    """A batch of (optionally weighted, optionally masked) point sets.

    points:  [B, M, d]  the points; encoders L2-normalise each row unless documented otherwise.
    weights: [B, M], or None for uniform weights 1/M (over the unmasked points).
    mask:    [B, M] bool, True = a real point (e.g. a non-padding token), or None for all real.
    weight_normalization: how :meth:`normalized_weights` turns ``weights`` into the mixture weights
      "sum":   w_i / Σ_j w_j (over the unmasked points); the weights must be > 0 (KME-CLIP's softplus
               weights, METHODS §3).
      "count": w_i / M_real, M_real = the number of unmasked points; the weights may have any sign
               and need not sum to 1 (the WPSE authors' scaled-tanh weights, whose weighted mean
               divides by the token count, METHODS §11).
      Both give the uniform 1/M_real when ``weights`` is None.

    A NamedTuple (not a dataclass) so that libraries which walk module outputs find its tensors:
    DeepSpeed ZeRO-3 re-gathers an encoder's parameters for backward through hooks it attaches to
    the tensors of the encoder's output, and it looks inside tuples, lists and dicts only.
    """

    __slots__ = ()

    def __new__(
        cls,
        points: Tensor,
        weights: Tensor | None = None,
        mask: Tensor | None = None,
        weight_normalization: str = "sum",
    ) -> PointSet:
        self = super().__new__(cls, points, weights, mask, weight_normalization)
        self._validate()
        return self

    def _validate(self) -> None:
        if self.points.dim() != 3:
            raise PointSetError(f"PointSet.points must be [B, M, d], got shape {tuple(self.points.shape)}")
        if self.weight_normalization not in WEIGHT_NORMALIZATIONS:
            raise PointSetError(
                f"PointSet.weight_normalization must be one of {WEIGHT_NORMALIZATIONS}, "
                f"got {self.weight_normalization!r}"
            )
        batch_points = tuple(self.points.shape[:2])
        for name in ("weights", "mask"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != batch_points:
                raise PointSetError(
                    f"PointSet.{name} must be [B, M] = {batch_points}, got {tuple(value.shape)}"
                )

    @property
    def batch_size(self) -> int:
        return self.points.shape[0]

    @property
    def num_points(self) -> int:
        return self.points.shape[1]

    @property
    def dim(self) -> int:
        return self.points.shape[2]

    def normalized_weights(self) -> Tensor:
        """[B, M] mixture weights, zero on masked points (uniform 1/M_real when weights is None).

        "sum": w / Σw, summing to 1 per row; "count": w / M_real (see the class docstring).
        """
        import torch

        weights = self.weights if self.weights is not None else torch.ones_like(self.points[..., 0])
        if self.mask is not None:
            weights = weights * self.mask.to(weights.dtype)
        if self.weight_normalization == "count" and self.weights is not None:
            count = (
                self.mask.sum(dim=1, keepdim=True).to(weights.dtype)
                if self.mask is not None
                else torch.full_like(weights[:, :1], float(self.num_points))
            )
            return weights / count.clamp_min(1.0)
        return weights / weights.sum(dim=1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)

    def mean(self) -> Tensor:
        """[B, d] weighted mean of the points (masked points excluded)."""
        return (self.normalized_weights().unsqueeze(-1) * self.points).sum(dim=1)

    def float(self) -> PointSet:
        """The same point set in fp32 (similarities and losses always run in fp32)."""
        return PointSet(
            self.points.float(),
            None if self.weights is None else self.weights.float(),
            self.mask,
            self.weight_normalization,
        )

    def cast(self, dtype: torch.dtype) -> PointSet:
        """The same point set with points and weights in ``dtype`` (``train.similarity_precision``)."""
        return self._map(lambda t: t.to(dtype))

    def detach(self) -> PointSet:
        """The same point set cut from the autograd graph."""
        return self._map(lambda t: t.detach())

    def rows(self, start: int, stop: int) -> PointSet:
        """Sets [start, stop) of the batch."""
        return self._map(lambda t: t[start:stop], mask=True)

    @classmethod
    def cat(cls, parts: Sequence[PointSet]) -> PointSet:
        """Concatenate point sets along the batch (all parts must have the same M)."""
        import torch

        first = parts[0]
        return cls(
            torch.cat([p.points for p in parts]),
            None if first.weights is None else torch.cat([p.weights for p in parts]),
            None if first.mask is None else torch.cat([p.mask for p in parts]),
            first.weight_normalization,
        )

    def union_by_group(self, groups: Tensor, weights: Tensor, *, fill_weight: float = 0.0) -> PointSet:
        """Zero-shot prompt ensembling by union (WPSE §2, KME §3): each group's prompts side by side.

        self: [B, M, d] prompt point sets; groups: [B] ids in [0, G), every id used; weights:
        [B, M] each prompt's per-point weights as the similarity defines them; they are divided by
        the group's prompt count K_g, so the union is the mean of the group's mixtures.
        -> PointSet [G, K·M, d], K the largest group: prompt
        k of group g fills slots k·M .. (k+1)·M − 1 of row g (in input order); unused slots and
        masked points have mask False, point 0 and weight ``fill_weight``. Points are never averaged.
        """
        import torch

        if groups.dim() != 1 or groups.shape[0] != self.batch_size:
            raise ValueError(f"groups must be [B] = [{self.batch_size}], got shape {tuple(groups.shape)}")
        if groups.numel() == 0 or int(groups.min()) < 0:
            raise ValueError("groups must be non-empty group ids >= 0")
        groups = groups.to(device=self.points.device, dtype=torch.long)
        counts = torch.bincount(groups)  # [G]
        if bool((counts == 0).any()):
            missing = torch.nonzero(counts == 0).flatten().tolist()
            raise ValueError(f"every group id 0..{counts.numel() - 1} needs a prompt; missing {missing}")
        num_groups, slots = counts.numel(), int(counts.max())
        # Slot of each prompt within its group: its rank among the group's prompts in input order.
        order = torch.argsort(groups, stable=True)
        starts = torch.cumsum(counts, 0) - counts  # [G] first sorted position of each group
        slot = torch.empty_like(groups)
        slot[order] = torch.arange(self.batch_size, device=groups.device) - starts[groups[order]]

        weights = weights / counts[groups].unsqueeze(1).to(weights.dtype)
        batch, points, dim = self.points.shape
        real = self.mask if self.mask is not None else torch.ones_like(weights, dtype=torch.bool)
        out_points = self.points.new_zeros(num_groups, slots, points, dim).index_put(
            (groups, slot), self.points
        )
        filled = torch.where(real, weights, torch.full_like(weights, fill_weight))
        out_weights = weights.new_full((num_groups, slots, points), fill_weight).index_put(
            (groups, slot), filled
        )
        out_mask = real.new_zeros(num_groups, slots, points).index_put((groups, slot), real)
        return PointSet(
            out_points.reshape(num_groups, slots * points, dim),
            out_weights.reshape(num_groups, -1),
            out_mask.reshape(num_groups, -1),
            self.weight_normalization,
        )

    def _map(self, function, *, mask: bool = False) -> PointSet:
        """``function`` applied to points and weights (and the mask when ``mask``)."""
        return PointSet(
            function(self.points),
            None if self.weights is None else function(self.weights),
            function(self.mask) if mask and self.mask is not None else self.mask,
            self.weight_normalization,
        )

    def to(self, device: torch.device | str) -> PointSet:
        return PointSet(
            self.points.to(device),
            None if self.weights is None else self.weights.to(device),
            None if self.mask is None else self.mask.to(device),
            self.weight_normalization,
        )


class Logits(NamedTuple):
    """Similarity logits, rows = anchors.

    i2t: [Na, Nb]  image anchors against text candidates.
    t2i: [Nb, Na]  text anchors against image candidates. Usually ``i2t.T``, but not for
                   CLOOB, whose Hopfield-retrieved embeddings differ per direction.

    A NamedTuple for the reason :class:`PointSet` is one (DeepSpeed ZeRO-3 finds its tensors).
    """

    i2t: Tensor
    t2i: Tensor

    @classmethod
    def symmetric(cls, i2t: Tensor) -> Logits:
        return cls(i2t=i2t, t2i=i2t.t())


@dataclass(frozen=True)
class LossOutput:
    """What a loss returns.

    loss:    scalar tensor to back-propagate (may be a surrogate, e.g. NUCLR's).
    metrics: user-facing numbers (the objective, accuracies, temperatures...); floats or 0-d tensors.
    """

    loss: Tensor
    metrics: Mapping[str, Any] = field(default_factory=dict)


#: Fields a loss may declare in ``requires``; the loop builds only those.
CONTEXT_FIELDS = frozenset({"index", "meta", "in_modal", "features", "step", "epoch"})


class LossContext:
    """Everything a loss may need beyond the logits, holding only what it declared.

    Fields (each present only when the loss lists it in ``requires``):
      index:    [N] long, global sample index in [0, n) (per-sample state: SogCLR, NUCLR).
      meta:     dict name -> [N] or [N, p] tensor of per-sample meta-data (y-Aware).
      in_modal: Logits-like pair with i2t = image-image [N, N], t2i = text-text [N, N].
      features: (image PointSet, text PointSet) of the global batch (CyCLIP, CLOOB).
      step:     int, optimiser step (schedules inside losses, e.g. NUCLR's ζ freeze).
      epoch:    float, fractional epoch.

    Reading a field the loss did not declare raises, so a missing ``requires`` entry is
    caught the first time the loss runs instead of silently reading stale data.
    """

    def __init__(self, **fields: Any) -> None:
        unknown = set(fields) - CONTEXT_FIELDS
        if unknown:
            raise TypeError(f"unknown LossContext fields {sorted(unknown)}; known: {sorted(CONTEXT_FIELDS)}")
        self._fields = dict(fields)

    def __getattr__(self, name: str) -> Any:
        fields = self.__dict__.get("_fields", {})
        if name in fields:
            return fields[name]
        if name in CONTEXT_FIELDS:
            raise AttributeError(
                f"LossContext.{name} was not supplied: add {name!r} to the loss's `requires`"
            )
        raise AttributeError(name)

    def __contains__(self, name: str) -> bool:
        return name in self._fields

    def __repr__(self) -> str:
        return f"LossContext({', '.join(sorted(self._fields))})"


# The whole contract between the host and its plugins is below: the methods every plugin of a kind
# has, and the optional members the host reads. Optional members have the defaults in
# ``OPTIONAL_MEMBERS``; the host reads them only through :func:`optional_member`, never with
# ``getattr`` of its own, so this file is the one list of what a plugin can declare.


@runtime_checkable
class Encoder(Protocol):
    """An ``nn.Module``: ``forward(inputs) -> PointSet``.

    Image encoders take ``[B, 3, H, W]`` float images; text encoders take ``[B, L]`` token ids
    (0 = padding) and build their mask from them.

    Optional members:
        projection_module_name: str | None = None — the attribute naming the tower's final
            projection module; the linear probe's ``features: pre_projection`` reads its input.
        grad_checkpointing: bool — any sub-module with this switch is turned on by
            ``train.grad_checkpointing``.
        sharding_blocks: ``() -> list[nn.Module]`` | None = None — the sub-modules FSDP2 shards
            one by one (``train.distributed.strategy=fsdp2``); None: the members of the tower's
            outermost ``nn.ModuleList``s (clipkit.train.runtime.wrapping).
    """

    def __call__(self, inputs: Tensor) -> PointSet: ...


@runtime_checkable
class Similarity(Protocol):
    """An ``nn.Module`` owning its learnable parameters (temperature, bandwidth, ...).

    Optional members:
        pairwise: bool = True — logits of a pair depend on that pair alone, so a process may score
            its own anchors against the gathered candidates (``train.distributed.local_loss``);
            False for batch-dependent similarities (CLOOB's Hopfield retrieval).
        uses_random_features: bool = False — the logits depend on the generator (WPSE); evaluation
            then reports mean ± std over feature seeds.
        half_features: bool = False — accepts bf16/fp16 point sets and returns fp32 logits (the
            products accumulated in fp32): ``train.similarity_precision: half`` hands it the
            towers' autocast dtype instead of upcast features.
        compiles: bool = False — the forward traces into one TorchDynamo graph (plain tensor code:
            no generator, no custom autograd Function, no Python value read off a tensor), so
            ``train.compile_scope: step`` compiles it with the loss (:mod:`clipkit.train.compile`).
        metrics() -> dict[str, float] — numbers logged every ``log_every`` (scale, bandwidth, ...).
        tile_features(x, *, generator) -> tuple of [B, ...] tensors, score_tile(fa, fb) -> [ta, tb]
            logits of those rows, score_pairs(fa, fb) -> [n] (optional), largest_tile(fa, fb) ->
            int | None (optional cap on the tile side): the tiled path (``train.tiled``,
            :mod:`clipkit.tiled.contract`); tiled_unsupported: str — why not.
        fused_form() -> clipkit.tiled.fused.AffineDot | None — the tiles are scale·a[0]·b[0]ᵀ + bias,
            so the fused Triton kernels may score them (:mod:`clipkit.tiled.fused`).
        parameter_bounds() -> dict[str, tuple[float | None, float | None]] — bounds (low, high;
            None: open) on the module's own learnable parameters, by attribute name; the training
            loop clamps those parameters in place after every applied optimiser step, as open_clip
            clamps CLIP's logit scale (the forward pass keeps the gradient). Declared by any module
            of a similarity or loss (e.g. the ``dot`` scale inside WPSE); see :mod:`clipkit.train.bounds`.
    """

    def __call__(self, a: PointSet, b: PointSet, *, generator: torch.Generator | None = None) -> Logits: ...

    def embed(self, x: PointSet, *, generator: torch.Generator | None = None) -> Tensor | None:
        """[B, D] vectors with ``embed(a) @ embed(b).T`` proportional to the logits, or None."""
        ...

    def ensemble(self, x: PointSet, groups: Tensor) -> PointSet:
        """Zero-shot prompt ensembling: points of ``x`` grouped by ``groups`` [B] (ids 0..G-1) -> G sets."""
        ...


@runtime_checkable
class Loss(Protocol):
    """``requires`` is a subset of :data:`CONTEXT_FIELDS`; the loop supplies only these.

    Optional members:
        supports_local_loss: bool = False — the loss is a mean over anchors, so the mean of the
            processes' local losses is the full-batch loss (``train.distributed.local_loss``).
        stateful: bool = False — the loss updates per-sample state from each batch it scores
            (SogCLR/NUCLR): the loop refuses exact gradient accumulation for it (which would score
            every batch twice) and stops, never skips, on a non-finite step (the state has already
            taken the batch in). Requiring ``index`` alone does not make a loss stateful.
        tiled_loss(logits: TiledLogits, ctx) -> LossOutput — the same loss from row/column
            reductions of tiles (``train.tiled``, :mod:`clipkit.tiled.contract`); tiled_unsupported:
            str — why the loss has no tiled form (``train.tiled: true`` then refuses with it).
        compiles: bool = False — as for a Similarity: ``__call__`` traces into one graph, so
            ``train.compile_scope: step`` compiles it with the similarity.
        fused_reductions: bool = False — ``tiled_loss`` may run in the fused Triton kernels (its
            reductions use the named terms of :mod:`clipkit.tiled.terms`; :mod:`clipkit.tiled.fused`).
        parameter_bounds() -> dict — as for a Similarity: learnable loss parameters kept in bounds
            after every optimiser step.
        similarity_refusal(similarity) -> str | None — why the loss cannot read this similarity's
            logits (None: it can), e.g. a temperature the two slots must share set differently;
            asked once the objective is built, the reason refused in one line.
    """

    requires: frozenset[str]

    def __call__(self, logits: Logits, targets: Tensor, ctx: LossContext) -> LossOutput: ...


class DistillView(NamedTuple):
    """One side of a distillation comparison (``train.distill``, docs/distillation.md): the student's
    or the teacher's view of the same anchors.

    logits: :class:`Logits` over the same rows and columns for both sides — i2t [Na, Nb] image
            anchors against text candidates, t2i [Nb', Na'] text anchors against image candidates,
            each side scaled by its own similarity (the teacher's own logit scale).
    image:  [Na, d] the image anchors' embeddings (the i2t rows), fp32.
    text:   [Nb', d] the text anchors' embeddings (the t2i rows), fp32.

    The full batch (global loss) or this process's anchors against the global candidates (local
    loss); d may differ between student and teacher.
    """

    logits: Logits
    image: Tensor
    text: Tensor


@runtime_checkable
class DistillLoss(Protocol):
    """``(student, teacher) -> LossOutput``: a distillation term (``register_distill_losses``). The
    teacher's tensors carry no gradient; the loss is a mean over anchors (so under a local loss the
    processes' mean is the full batch's).

    Optional members:
        compares_features: bool = False — compares student and teacher embeddings one to one (cosine,
            MSE): the host refuses a teacher whose embedding width differs from the student's.
    """

    def __call__(self, student: DistillView, teacher: DistillView) -> LossOutput: ...


#: Optional plugin members the host reads, with the value a plugin that does not declare one has.
OPTIONAL_MEMBERS: dict[str, Any] = {
    "requires": frozenset(),  # Loss
    "supports_local_loss": False,  # Loss
    "stateful": False,  # Loss
    "compares_features": False,  # DistillLoss: needs equal student and teacher embedding widths
    "pairwise": True,  # Similarity
    "uses_random_features": False,  # Similarity
    "half_features": False,  # Similarity: takes bf16/fp16 points, returns fp32 logits
    "compiles": False,  # Similarity or Loss: traceable by torch.compile in one graph (train.compile_scope)
    "tile_features": None,  # Similarity: tiled path (clipkit.tiled.contract)
    "score_tile": None,  # Similarity
    "score_pairs": None,  # Similarity (optional speed-up of the positives)
    "largest_tile": None,  # Similarity (optional cap on train.tile_size)
    "tiled_loss": None,  # Loss: tiled path
    "tiled_unsupported": None,  # Similarity or Loss: why it has no tiled form
    "fused_form": None,  # Similarity: () -> clipkit.tiled.fused.AffineDot | None (fused kernels)
    "fused_reductions": False,  # Loss: its tiled_loss may run in the fused kernels
    "parameter_bounds": None,  # any module of a Similarity or Loss: clamped after each optimiser step
    "similarity_refusal": None,  # Loss: (similarity) -> str | None, asked when the objective is built
    "projection_module_name": None,  # Encoder
    "sharding_blocks": None,  # Encoder: FSDP2's units (clipkit.train.runtime.wrapping)
    # Encoder *factory* (read by recipe validation, before anything is built): the tokenizer slot a
    # pretrained text tower needs, e.g. {"name": "wordpiece", "vocab": "minilm"}; None: any tokenizer.
    "required_tokenizer": None,
}


def optional_member(plugin: Any, name: str) -> Any:
    """``plugin``'s declared value of the optional member ``name``, else its default above."""
    value = getattr(plugin, name, OPTIONAL_MEMBERS[name])
    return frozenset(value) if name == "requires" else value


def similarity_metrics(similarity: Any) -> dict[str, float]:
    """The similarity's optional ``metrics()`` (empty when it declares none)."""
    metrics = getattr(similarity, "metrics", None)
    return dict(metrics()) if callable(metrics) else {}


@runtime_checkable
class Tokenizer(Protocol):
    """Texts -> ``[B, context_length]`` long token ids, 0 = padding."""

    vocab_size: int
    context_length: int

    def __call__(self, texts: list[str]) -> Tensor: ...


@dataclass(frozen=True)
class Sample:
    """One record a data source yields for ``clipkit shard`` and for evaluation.

    image:     encoded image bytes (PNG, JPEG, ...), stored as-is in shards.
    image_ext: the extension naming the encoding ("png", "jpg").
    captions:  one or more captions (retrieval counts a hit if any matches).
    meta:      JSON-serialisable per-sample meta-data (labels, continuous proxies).
    key:       a stable, unique key within the source.
    """

    key: str
    image: bytes
    image_ext: str
    captions: tuple[str, ...]
    meta: Mapping[str, Any] = field(default_factory=dict)


class Source(Protocol):
    """What an ``open_source`` hook returns."""

    def __iter__(self): ...  # yields Sample

    def info(self) -> dict[str, Any]:
        """JSON-serialisable description saved in the manifest (labels, class names, templates)."""
        ...
