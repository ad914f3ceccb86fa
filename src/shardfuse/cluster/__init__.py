"""The cluster: what SLURM can grant, one owner per training, and the membership (who trains what).

A library package: it never imports a stage. This file stays a docstring (no imports).
"""
