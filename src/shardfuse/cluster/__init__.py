"""The cluster: what SLURM can grant, and one owner per training.

A library package: it never imports a stage. This file stays a docstring (no imports).
"""
