"""Tests of shardfuse.console."""
