"""What runs beside the flows, without Prefect: the local server, the watcher, backfill's steps, signals."""
