"""`scdd`: self-correcting discrete diffusion on a masked-diffusion backbone (docs/strategies.md §8.2).

`options.py` declares the options, samplers and registration (torch-free), `strategy.py` the class,
`schedule.py` the mask + uniform schedule and the training grid, `loss.py` the discrete-time NELBO,
`sampling.py` the ancestral posterior sampler.
"""
