"""The training runtime behind the train stage: the one loop (`loop`), the model + strategy + loss assembly
(`trainee`, `dflash_setup` for a draft and its frozen target), device, optimizer and data order (`runtime`),
the checkpoint a rerun resumes from (`resume`) and torchrun (`distributed`, `torchrun_entry`)."""
