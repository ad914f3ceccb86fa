"""Data: the shard format, the manifest, the shard reader; the dataset sources in sources/.

A library package: it never imports a stage. This file stays a docstring (no imports).
"""
