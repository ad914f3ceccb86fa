"""One rank of a training: process group, set-up, optimiser, resume, validation, progress (the strategies
that keep ranks in touch are :mod:`shardfuse.strategies`).

A library package: it never imports a stage. This file stays a docstring (no imports).
"""
