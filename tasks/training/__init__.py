"""The training runtime behind the train stage: the one loop (`loop`), the model + strategy + loss assembly
(`trainee`; a draft's and its frozen target's builders are the speculative wing's, `tasks.speculative.setup`), the
optimizer and data order (`runtime`),
the checkpoint a rerun resumes from (`resume`) and torchrun (`distributed`, `torchrun_entry`)."""
