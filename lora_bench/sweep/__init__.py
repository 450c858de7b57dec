"""Sweeps: YAML specs expanded into planned runs, and the runner that executes them."""
