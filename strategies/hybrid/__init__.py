"""`hybrid`: diffusion + autoregressive training of one backbone, Nemotron-Labs-Diffusion style
(docs/strategies.md §8.3).

`options.py` declares the options, samplers and registration (torch-free), `strategy.py` the class,
`loss.py` the diffusion + AR loss, `sampling.py` the causally seeded block sampler.
"""
