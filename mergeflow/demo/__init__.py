"""The tiny, real checkpoints the demo and the benchmarks build (shipped: nothing here is test-only).

Real Diffusers transformers at tiny (or requested) sizes, and per-rank files written by the
real `fully_shard` on a single-process fake process group, exactly as FSDP2 training writes them.
The test suite's other builders (pipelines, tokenizers, remote-code models, reference
conversions) live in tests/fixtures/.
"""
