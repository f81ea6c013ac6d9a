"""What the prepare_data stage (`tasks/prepare_data.py`) is built from, one module per step: the documents
(`documents`: the embedded corpus and user files read, checked and split by document), the tokenizer
(`tokenizer`: trained, loaded, its [MASK] id checked), the documents tokenized (`tokenizing`: in this process or
a pool of processes) and one split's rows as they are produced (`split_rows`)."""
