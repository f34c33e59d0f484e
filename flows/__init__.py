"""What runs: the Prefect flows and their entry points (command line, Python API)."""
