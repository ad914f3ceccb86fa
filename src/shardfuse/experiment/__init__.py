"""The experiment: the config file and its schema, the runs table, each run's checks and its training's
identity. Torch-free: the Snakefile imports it.

A library package: it never imports a stage. This file stays a docstring (no imports).
"""
