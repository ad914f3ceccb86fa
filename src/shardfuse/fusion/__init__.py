"""Fusion: the streaming merge engine, LoRA adapters fused in update space, alignment, recalibration; the
methods in methods/.

A library package: it never imports a stage. This file stays a docstring (no imports).
"""
