"""Built-in data sources (``open_source``, a firstresult hook): clipkit shard directories, the
synthetic shapes, standard dataset layouts and local files/tables.

The one hook is ``trylast``, so a third-party ``open_source`` can take over any URI. It tries
the readers from the most specific URI form to the most general; each returns None for a URI
that is not its form. Implementations are imported inside the hook.
"""

from __future__ import annotations

from pathlib import Path

from clipkit.contract.hookspecs import hookimpl


@hookimpl(trylast=True)
def open_source(uri, options):
    from clipkit.data.shard import MANIFEST, ShardSource
    from clipkit.plugins.sources.clip_benchmark_source import open_clip_benchmark_source
    from clipkit.plugins.sources.dataset_sources import open_dataset_source
    from clipkit.plugins.sources.file_sources import open_file_source
    from clipkit.plugins.sources.holdout_source import open_holdout_source
    from clipkit.plugins.sources.source_options import check_option_names
    from clipkit.plugins.sources.synthetic_shapes import parse_synthetic_uri

    # Here, not in each reader: a plugin that opens the URI itself (before this trylast hook) may
    # take options of its own, but no built-in source reads a key outside this list.
    check_option_names(options or {})
    held_out = open_holdout_source(uri, options)  # holdout:DATA?fraction=F (clipkit train --data)
    if held_out is not None:
        return held_out
    synthetic = parse_synthetic_uri(uri)
    if synthetic is not None:
        return synthetic
    if "://" not in uri and (Path(uri) / MANIFEST).is_file():
        return ShardSource(uri)
    benchmark = open_clip_benchmark_source(uri, options)  # wds:DIR, or a CLIP_benchmark wds folder
    if benchmark is not None:
        return benchmark
    dataset = open_dataset_source(uri, options)
    if dataset is not None:
        return dataset
    from clipkit.data.shard_sets import StreamedShardSource, is_streamed, is_tar_folder

    if is_streamed(uri) or is_tar_folder(uri):  # URLs, brace lists, pipe:, s3:// ...: read in place
        return StreamedShardSource(uri)
    return open_file_source(uri, options)
