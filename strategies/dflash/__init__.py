"""`dflash`: a block-diffusion draft trained against a frozen causal target (docs/strategies.md §8.5, §10).

`options.py` declares the options, the speculative sampler, the draft's model shape and the registration
(torch-free), `strategy.py` the class, `blocks.py` the anchor blocks, copy hints and mask, `loss.py` the decay
and D-PACE losses, `draft.py` the draft model and speculative decoding, `features.py` the target's features
(online or cached).
"""
