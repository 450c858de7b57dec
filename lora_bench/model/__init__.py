"""GPT-2 as the reference builds it: sizes, the model, and its pretrained checkpoints."""
