"""What the commands outside the DAG run: `dllm-flow plan` (`plan`), `generate`, `export` (`export`; a DFlash
draft's in `tasks.speculative.export`), the model card from `model_card` and `provenance`, the loading snippets in
`snippets/`."""
