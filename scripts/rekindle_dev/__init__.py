"""Rekindle's developer tools: the tiny model, benchmarks, the test harness (never shipped)."""
