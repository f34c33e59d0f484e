"""`python -m mergeflow`: the same command line as the `mergeflow` console script."""

import sys

try:
    from mergeflow.deployments.cli import entry
except KeyboardInterrupt:  # Ctrl-C while Python was still importing: nothing had started
    print("mergeflow: interrupted (SIGINT) while starting; nothing was done", file=sys.stderr)
    raise SystemExit(130) from None

if __name__ == "__main__":
    entry()
