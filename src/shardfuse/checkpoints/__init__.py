"""Checkpoints: safetensors weights with JSON metadata, streamed tensors, trust checks.

A library package: it never imports a stage. This file stays a docstring (no imports).
"""
