"""On-disk formats: rank files (safe loading), safetensors headers, the verl checkpoint layout, the manifest."""
