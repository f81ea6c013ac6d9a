"""Shared plumbing for dllm-flow: config schema, stage store, checkpoint IO and tracking.

This package sits at the bottom of the import graph (flows → tasks → strategies → dllm_common)
and must not import torch at module level, so the orchestration layer stays CUDA-free.
"""
