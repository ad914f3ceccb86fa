"""Partitioners: which rank's shard each training row goes to (the registry of records in registry.py).

A library package: it never imports a stage. This file stays a docstring (no imports).
"""
