"""Reproducible speed and memory measurements (not part of the test suite). Run: ./dev bench <name>."""
