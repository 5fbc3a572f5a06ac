"""Megatron-LM checkpoints in and out. The room holds what both of Megatron-LM's formats share; each format
has its own room below, and the two never import each other.

Where to start reading:

    read.py          read_megatron(): the one entry of an import. Finds the iteration folder (the tracker
                     through paths.read_tracker, the one strict reader), tells the format and opens it:
                       torch_dist -> torch_dist/reader.py (DistCheckpoint); its distributed optimizer's
                                     dp_reshardable buckets -> torch_dist/dp_optim.py (+ dp_stages.py)
                       legacy     -> legacy/reader.py (LegacyCheckpoint); its optimizer state ->
                                     legacy/optim.py, legacy/distrib_optim.py (distrib_optim.pt)
                     and returns a MegatronCheckpoint, whose .full() is the layout-free full checkpoint
                     every converter writes from (checkpointing/full.py, the meeting point).
    load.py          load_megatron(): ``pretrain_gpt.py --load`` of a Megatron-LM folder, in-process.
    export.py        the rules every export shares (megatron-core names, the saved ``args``, vocab padding);
                       torch_dist/writer.py (save_torch_dist), legacy/writer.py (save_legacy) write them.

Shared by both formats: names.py (megatron-core <-> megalite tensor names), args.py (``args`` -> model
config), tp.py (how a tensor is cut over TP), buffer.py (the distributed optimizer's flat buffers),
rng.py (saved RNG states), safe_pickle.py (the unpickling allow-list).
"""
