"""One rank of a training: process group, sync strategies, optimiser, resume, validation, progress.

A library package: it never imports a stage. This file stays a docstring (no imports).
"""
