"""Rebuilding global tensors from rank pieces, proven by a round trip: layouts, rank indexes, reconstruction."""
