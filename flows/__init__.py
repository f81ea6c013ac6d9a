"""Prefect flows: composition of the stages into pipelines, and the CLI."""
