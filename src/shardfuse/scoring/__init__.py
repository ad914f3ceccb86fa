"""Scoring: weights scored on named evaluation sets. One way to turn a model and a split into the task's
metrics, shared by evaluate, greedy soup, recalibration's passes over the validation split (and merge
search next); the evaluation-set records in sets.py.

A library package: it never imports a stage, nor fusion (fusion imports it). This file stays a docstring.
"""
