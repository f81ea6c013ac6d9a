"""Pipeline stages: one module per stage, each a plain function plus a thin Prefect task."""
