"""Benchmarks: scripts run in one device call each; their results go into BENCHMARKS.md."""
