"""The pipeline's stages — what the DAG runs — and what they share.

One module per stage, each a plain function plus a thin Prefect task (`prepare_data`, `target`, `regenerate`,
`cache_target`, `train`, `evaluate`, `report`), with what every stage reads (`common`: the stage descriptor,
code versions, the Prefect wrapper; `rows`: the prepared rows). The machinery behind them lives in
subpackages named for what they hold: `data/` (the documents, tokenizer, tokenizing and rows of
`prepare_data`), `training/` (the loop, the model and strategy assembly, checkpoints to resume from,
torchrun), `evaluation/` (likelihoods, samples and their scoring, the data row, DFlash acceptance, the lm-eval
model) and `commands/` (what `dllm-flow plan | generate | export` run).
"""
