"""The registry, the pipeline contract, the model schema, and per-architecture adapters."""
