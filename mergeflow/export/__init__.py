"""The export engine: reconstructing tensors from rank shards and proving them, writing and
reading back shards, and what an export writes (no Prefect below this line; tasks/ wraps it)."""
