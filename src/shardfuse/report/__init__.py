"""Reports: figures of results/summary.csv.

A library package: it never imports a stage. This file stays a docstring (no imports).
"""
