"""`block_diffusion`: a DiffusionGemma-style encoder + noised canvas (docs/strategies.md §8.6, §9).

`options.py` declares the options, samplers, model shape and registration (torch-free), `strategy.py` the
class and the canvas window, `loss.py` the canvas loss with analytic own-token evidence, `model.py` the
encoder + canvas model, `sampling.py` the canvas sampler. The uniform kernel's maths it shares are in
`strategies.corruption`, `strategies.posteriors` and `strategies.losses`; its mask in `strategies.masks`.
"""
