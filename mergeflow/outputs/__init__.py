"""Artifact outputs: one protocol (`base.ArtifactOutput`), one module per kind, one registry.

An output decides everything that differs between the artifacts mergeflow writes: what it needs
of the base, its targets and file names, how tensor names map into it, its writer, what is copied
from the base, what `test` checks and its manifest `artifact_type`. Nothing outside this package
branches on an output format or an artifact type; `registry.py` lists the kinds.
"""
