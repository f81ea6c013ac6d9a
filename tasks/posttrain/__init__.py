"""Post-training: chat SFT data and the verifiable tasks its rewards check (docs/post-training.md)."""
