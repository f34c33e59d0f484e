"""Checking an artifact: the staged check before publish, `test` on any artifact, the unchanged-weights guard."""
