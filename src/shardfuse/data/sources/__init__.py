"""Dataset sources: tables (scikit-learn, Parquet, CSV, text), images, synthetic data.

A library package: it never imports a stage. This file stays a docstring (no imports).
"""
