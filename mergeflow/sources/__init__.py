"""Training checkpoint sources: one protocol (base.py), one module per kind (verl.py, dcp.py), one registry.

See docs/extending.md, "Adding a checkpoint source".
"""
