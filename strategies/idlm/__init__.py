"""`idlm`: introspective diffusion, converting a causal LM into a dLLM (docs/strategies.md §8.4).

`options.py` declares the options, samplers and registration (torch-free), `strategy.py` the class,
`loss.py` the two-half loss, `sampling.py` introspective strided decoding. Its attention mask is in
`strategies.masks`; its default sampler is the absorbing one with logit shift 1 (`strategies.absorbing`).
"""
