"""`mdlm`: MDLM / LLaDA masked diffusion (docs/strategies.md §8.1).

`options.py` declares the options and the registration (torch-free), `strategy.py` the class, `loss.py`
the 1/t-weighted masked cross-entropy. It samples with the absorbing sampler (`strategies.absorbing`).
"""
