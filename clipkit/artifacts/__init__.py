"""What clipkit writes and reads back: exports (export writes, reader reads — the reader imports no
training code), clipkit.load (loading), checksums and contained paths (integrity), atomic writes
(io), pickle-free loading (safe_load), reading JSON/YAML with one-line errors (files).
"""

from clipkit.artifacts.files import one_line, read_json_object, read_yaml_mapping  # noqa: F401
