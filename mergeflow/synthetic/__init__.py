"""Builders of tiny, real checkpoints and pipelines (demo, tests, benchmarks)."""
