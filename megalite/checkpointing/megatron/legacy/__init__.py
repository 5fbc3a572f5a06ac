"""Megatron-LM legacy checkpoints: mp_rank_* folders of model_optim_rng.pt (and distrib_optim.pt), read and written."""
