"""`python -m mergeflow`: the same command line as the `mergeflow` console script."""

from mergeflow.flows.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
