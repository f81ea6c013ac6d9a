"""`dflash`: a block-diffusion draft trained against a frozen causal target (docs/strategies.md §8.5, §10).

`options.py` declares the options, the speculative sampler, the draft's model shape and the registration
(torch-free), `strategy.py` the class, `blocks.py` the anchor blocks, copy hints and mask, `loss.py` the decay
and D-PACE losses, `config.py` the draft's configuration and the serving engines' config.json layouts
(torch-free), `draft.py` the draft model (the engines' `DFlashDraftModel`), `decoding.py` speculative decoding,
`tree.py` tree verification (several branches per target forward), `features.py` the target's features (online or
cached), `dflash2.py` DFlash 2's in-block convolutions, path selector and objective, `dflash2_config.py` its
configuration keys (torch-free); `prefix.py` the shown prefixes of `variable_prefix`, `domino.py` Domino's head,
`window.py` / `window_config.py` sliding-window drafts, `served_checks.py` / `serving_layout.py` what serving checks.
"""
