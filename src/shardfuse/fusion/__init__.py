"""Fusion: the merge stage's paths (fuse.py), the streaming merge engine, LoRA adapters fused in update
space, alignment, recalibration, greedy soup; the methods in methods/.

A library package: it never imports a stage. This file stays a docstring (no imports).
"""
