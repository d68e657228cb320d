"""Built-in data sources: existing clipkit shard directories and the synthetic shapes.

Both are ``trylast`` so a third-party ``open_source`` can take over any URI.
"""

from __future__ import annotations

from pathlib import Path

from clipkit.hookspecs import hookimpl


@hookimpl(trylast=True)
def open_source(uri, options):
    from clipkit.plugins.synthetic_shapes import parse_synthetic_uri
    from clipkit.shard import MANIFEST, ShardSource

    synthetic = parse_synthetic_uri(uri)
    if synthetic is not None:
        return synthetic
    if "://" not in uri and (Path(uri) / MANIFEST).is_file():
        return ShardSource(uri)
    return None
