"""quickstart@smoke's shards, made once per xdist worker (the ``smoke_shards`` fixture of
tests/conftest.py), placed where a test's run reads them."""

from __future__ import annotations

from pathlib import Path


def place_smoke_shards(directory: Path, smoke_shards: tuple[Path, Path]) -> None:
    """Copy the shards of :func:`smoke_shards` to where quickstart@smoke reads them from
    ``directory``."""
    import shutil

    shards, relative = smoke_shards
    shutil.copytree(shards, Path(directory) / relative)
