"""Benchmarks: measured side by side in one process, reported as ratios to a baseline."""
