"""Pipeline parallelism: stage partitioning, schedule tables, executor and p2p."""
