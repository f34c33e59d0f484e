"""Writing the artifact's files: streamed safetensors shards, copied base files, and reading them back."""
