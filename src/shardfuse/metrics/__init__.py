"""Metrics written while training runs: step metrics and system metrics.

A library package: it never imports a stage. This file stays a docstring (no imports).
"""
