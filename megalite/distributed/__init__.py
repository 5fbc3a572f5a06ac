"""Data-parallel gradient reduction and sharding (buffers, the distributed optimizer's shards, ZeRO-3,
compression), and the per-step gradient finalization."""
