"""`prefect.yaml`: mergeflow's three deployments for `prefect deploy` and workers.

`mergeflow serve` builds the same deployments in code (mergeflow.deployments.serve); tests/test_ops.py
keeps the two in step.
"""
