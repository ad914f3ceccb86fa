"""Dataset sources: one record each (registry), their behaviour in source modules (tables, images,
synthetic, text), and the library of the prepare stage (spec checks, writing the splits, dataset.json).

A library package: it never imports a stage. This file stays a docstring (no imports).
"""
