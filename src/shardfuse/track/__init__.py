"""MLflow: the client and writer lock, the sync of a run and its plan, idempotent pushes, the logged
model, inputs, UI, live runs.

A library package: it never imports a stage. This file stays a docstring (no imports).
"""
