"""Models: the registry, the built-in factories, specs read without torch, tasks, user code.

A library package: it never imports a stage. This file stays a docstring (no imports).
"""
