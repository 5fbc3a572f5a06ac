"""Megatron-LM checkpoints in and out: the format-independent argument, name and RNG rules here, the
torch_dist (distributed checkpointing) and legacy (torch.save per rank) formats in their own rooms."""
