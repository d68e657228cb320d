"""Training batches from shards: WebDataset split by node and worker, exact resume.

Not passed through ``accelerator.prepare`` (its dispatcher would read rank 0's stream
only): WebDataset's own node/worker splitters give each rank and worker its shards.

Order is a pure function of (seed, epoch, rank, worker), so a resumed run that skips
the batches it already consumed sees exactly the batches an uninterrupted run sees.
Batches are built from *undecoded* records first, so skipping costs I/O, not decoding.
"""

from __future__ import annotations

import io
import random
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils.data

from clipkit.errors import DataError
from clipkit.shard import decode_record, read_manifest, shard_urls
from clipkit.transforms import ImageTransform

__all__ = ["BatchStream", "EpochDataset", "ImageTransform", "decode_image", "skipped_by_worker"]


def decode_image(data: bytes, where: str):
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Exception as error:  # PIL raises many types for corrupt data
        raise DataError(f"{where}: cannot decode image ({error})") from error
    return image


class EpochDataset(torch.utils.data.IterableDataset):
    """One epoch of one rank's batches: an iterable WebDataset pipeline (a torch IterableDataset)."""

    def __init__(
        self,
        urls,
        *,
        batch_size,
        transform,
        tokenizer,
        seed,
        epoch,
        skip_batches,
        shuffle_buffer,
        views,
        meta_keys=None,
    ):
        self.urls, self.batch_size, self.transform, self.tokenizer = urls, batch_size, transform, tokenizer
        self.seed, self.epoch, self.skip_batches = seed, epoch, skip_batches
        self.shuffle_buffer, self.views = shuffle_buffer, views
        self.meta_keys = dict(meta_keys or {})

    def pipeline(self, worker: int, num_workers: int):
        import webdataset as wds

        shard_order = list(self.urls)
        random.Random(f"shards:{self.seed}:{self.epoch}").shuffle(shard_order)
        stages = [
            wds.SimpleShardList(shard_order),
            wds.split_by_node,
            wds.split_by_worker,
            wds.tarfile_to_samples(),
        ]
        if self.shuffle_buffer > 1:
            rng = random.Random(f"samples:{self.seed}:{self.epoch}:{rank()}:{worker}")
            stages.append(wds.shuffle(self.shuffle_buffer, initial=self.shuffle_buffer, rng=rng))
        stages.append(wds.batched(self.batch_size, collation_fn=list, partial=False))
        return wds.DataPipeline(*stages), skipped_by_worker(self.skip_batches, worker, num_workers)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        pipeline, skip = self.pipeline(worker, num_workers)
        for position, records in enumerate(pipeline):
            if position >= skip:
                yield self.collate(records)

    def collate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Decode raw records into a batch: image [B,3,S,S] (and image2 in two-view mode),
        text [B,L] token ids, index [B] global indices, meta {name: list}."""
        samples = [decode_record(record, "shards") for record in records]
        rngs = [random.Random(f"aug:{self.seed}:{self.epoch}:{s.meta['index']}") for s in samples]
        images = [decode_image(s.image, f"sample {s.meta['index']} ({s.key})") for s in samples]
        batch: dict[str, Any] = {
            "image": torch.stack([self.transform(im, rng) for im, rng in zip(images, rngs, strict=True)]),
            "index": torch.tensor([int(s.meta["index"]) for s in samples], dtype=torch.long),
            "meta": batch_meta(samples, self.meta_keys),
        }
        if self.views == 2:
            batch["image2"] = torch.stack(
                [self.transform(im, rng) for im, rng in zip(images, rngs, strict=True)]
            )
        if self.tokenizer is not None:
            # One caption per sample per epoch, chosen reproducibly among the sample's captions.
            batch["text"] = self.tokenizer(
                [rng.choice(s.captions) for s, rng in zip(samples, rngs, strict=True)]
            )
        return batch


def batch_meta(samples, meta_keys: dict[str, str]) -> dict[str, list]:
    """{key: [value per sample]} for every meta-data key of the first sample (but ``index``), plus
    each ``name: source`` of ``meta_keys`` as ``name`` holding the values of ``source``."""
    present = [k for k in samples[0].meta if k != "index"]
    meta = {k: [s.meta.get(k) for s in samples] for k in present}
    for name, source in meta_keys.items():
        if source not in samples[0].meta:
            raise DataError(
                f"data.meta_keys: {name} <- {source!r}, but the shards' meta-data has only {sorted(present)}"
            )
        meta[name] = meta[source]
    return meta


def skipped_by_worker(skip_batches: int, worker: int, num_workers: int) -> int:
    """How many of ``worker``'s batches precede global batch ``skip_batches``.

    The DataLoader takes batches from workers round-robin: global batch j comes from
    worker j % W as that worker's (j // W)-th batch.
    """
    if skip_batches <= worker:
        return 0
    return (skip_batches - worker + num_workers - 1) // num_workers


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class BatchStream:
    """Endless batches over epochs; ``position`` is saved in checkpoints for exact resume."""

    def __init__(
        self,
        shards,
        *,
        batch_size,
        transform,
        tokenizer,
        seed,
        num_workers=0,
        shuffle_buffer=1000,
        views=1,
        meta_keys=None,
    ):
        self.urls = shard_urls(shards)
        self.num_samples = int(read_manifest(shards)["n"])
        self.batch_size, self.transform, self.tokenizer = batch_size, transform, tokenizer
        self.seed, self.num_workers, self.shuffle_buffer, self.views = (
            seed,
            num_workers,
            shuffle_buffer,
            views,
        )
        self.meta_keys = dict(meta_keys or {})
        self.epoch, self.batch_in_epoch = 0, 0
        if self.num_samples < batch_size:
            raise DataError(f"{shards}: {self.num_samples} samples are fewer than one batch of {batch_size}")

    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    def restore(self, position: dict[str, int]) -> None:
        self.epoch, self.batch_in_epoch = int(position["epoch"]), int(position["batch_in_epoch"])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while True:
            produced = False
            for batch in self.loader(self.epoch, self.batch_in_epoch):
                produced = True
                self.batch_in_epoch += 1
                yield batch
            if not produced and self.batch_in_epoch == 0:
                raise DataError("the shards yielded no full batch; lower data.batch_size")
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0

    def loader(self, epoch: int, skip_batches: int):
        dataset = EpochDataset(
            self.urls,
            batch_size=self.batch_size,
            transform=self.transform,
            tokenizer=self.tokenizer,
            seed=self.seed,
            epoch=epoch,
            skip_batches=skip_batches,
            shuffle_buffer=self.shuffle_buffer,
            views=self.views,
            meta_keys=self.meta_keys,
        )
        return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=self.num_workers)
