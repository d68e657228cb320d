"""Batches already in memory as a training stream: what benchmarks, tests and notebooks feed the
one training loop when the data is not the point (:class:`InMemoryStream`)."""

from __future__ import annotations

from collections.abc import Iterator


class InMemoryStream:
    """Cycles over ``batches`` (dicts as :class:`clipkit.data.loader.BatchStream` yields them:
    ``image`` [B, 3, S, S], ``text`` [B, L], ``index`` [B], optional ``meta``) for ever, keeping the
    stream protocol the loop and checkpoints read (clipkit.train.trainer.TrainingStream):
    ``num_samples`` (the samples of one pass), ``epoch``, ``batch_in_epoch``, ``position``/``restore``.

    ``batches`` may be filled after the stream is made (a benchmark learns the sizes from the built
    trainer); ``num_samples`` is read from it each time.

    >>> import torch
    >>> stream = InMemoryStream([{"index": torch.arange(4)}, {"index": torch.arange(4, 8)}])
    >>> batches = iter(stream); _ = next(batches); _ = next(batches); _ = next(batches)
    >>> stream.position(), stream.num_samples
    ({'epoch': 1, 'batch_in_epoch': 1}, 8)
    """

    def __init__(self, batches: list[dict]) -> None:
        self.batches = batches
        self.epoch, self.batch_in_epoch = 0, 0

    @property
    def num_samples(self) -> int:
        return sum(len(batch["index"]) for batch in self.batches)

    def __iter__(self) -> Iterator[dict]:
        while True:
            for position, batch in enumerate(self.batches):
                if position < self.batch_in_epoch:  # resumed mid-pass: skip what was taken
                    continue
                self.batch_in_epoch = position + 1
                yield batch
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0

    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    def restore(self, position: dict[str, int]) -> None:
        self.epoch, self.batch_in_epoch = int(position["epoch"]), int(position["batch_in_epoch"])
