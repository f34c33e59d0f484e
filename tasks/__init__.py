"""The steps of an export: plain functions (tested directly) plus their Prefect task wrappers."""
