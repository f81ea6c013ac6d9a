"""The speculative-decoding wing: every stage and step a draft trained against a frozen causal target needs, in one
place (docs/strategies.md §8.5, docs/architecture.md "The pipeline").

Stages, each a declared stage (`tasks.stages`): the frozen target (`target`: `pretrain_target` trains a small one,
`target` records a given one), its own continuations of the training rows (`regenerate`) and its hidden states over
them (`cache_target`). What they and the train and evaluate stages share: the draft's setup, built once per stage
from the config (`setup.DraftSetup`: resolved options, an imported draft's config, the target's layers), the target
and draft builders (`setup`). After training: acceptance measured by speculative decoding (`acceptance`), the check
against a serving engine's own decoding (`served`), the report's table (`table`) and the export in the formats the
engines load (`export`).

Nothing here imports the training runtime (`tasks.training`) except `target`'s pretraining, which is a training of
its own.
"""
