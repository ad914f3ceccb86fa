"""Merge methods as pure float64 array math on the N ranks' versions of one tensor.

A library package: it never imports a stage. This file stays a docstring (no imports).
"""
