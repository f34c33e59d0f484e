"""Filesystem primitives, hashing stream writer, strict JSON, path rules, staging dirs."""
