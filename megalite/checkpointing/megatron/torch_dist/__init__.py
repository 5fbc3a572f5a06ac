"""Megatron-LM torch_dist checkpoints: the .distcp reader and the distributed optimizer's dp_reshardable state."""
