"""The pipeline's stages — what the DAG runs — and what they share.

One module per stage, each a plain function plus a thin Prefect task and its declaration (`prepare_data`, `train`,
`evaluate`, `report`; DFlash's `target`, `regenerate` and `cache_target` in the speculative wing), with what every
stage reads (`stages`: the declarations and the graph derived from them; `common`: the stage descriptor, code
versions, the Prefect wrapper; `devices`; `rows`: the prepared rows). The machinery behind them lives in
subpackages named for what they hold: `data/` (the documents, tokenizer, tokenizing and rows of
`prepare_data`), `training/` (the loop, the model and strategy assembly, checkpoints to resume from,
torchrun), `evaluation/` (likelihoods, samples and their scoring, the data row, the lm-eval model), `speculative/`
(the DFlash wing: target, regeneration, feature cache, draft setup, acceptance, served check, report table, export)
and `commands/` (what `dllm-flow plan | generate | export` run).
"""
