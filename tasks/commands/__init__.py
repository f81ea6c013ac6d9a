"""What the commands outside the DAG run: `dllm-flow plan` (`plan`), `generate`, `export` (`export`,
`export_draft` for a DFlash draft, the model card from `model_card` and `provenance`, the loading snippets in
`snippets/`)."""
