"""The console: a stage's one-line error (the CLI error gate) and the workflow's report of its failed
jobs, read back from their logs.

A library package: it never imports a stage. This file stays a docstring (no imports).
"""
