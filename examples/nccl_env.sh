# The environment a multi-GPU megalite run needs; sourced by the launch scripts in this folder.
# Every variable keeps a value you exported before (`NCCL_DEBUG=INFO bash examples/...`).
#
# CUDA_DEVICE_MAX_CONNECTIONS=1
#   One hardware work queue per GPU, so kernels start in the order the host launched them. Megatron
#   relies on this to get a tensor-parallel collective (launched just before the GEMM it feeds) scheduled
#   ahead of that GEMM, which is what makes TP/sequence-parallel communication overlap with compute. It
#   costs nothing for megalite's data-parallel overlap (NCCL still runs on its own stream). Leave it unset
#   (default 8) only with FSDP-style sharding that needs several concurrent queues.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
#
# NCCL_DEBUG=WARN | INFO | TRACE
#   WARN prints only problems. INFO at start-up prints, per rank, the NCCL version, the network it chose
#   ("NET/IB : Using [0]mlx5_0:1/IB" is InfiniBand; "NET/Socket" means it fell back to TCP: 10-50x slower
#   across nodes) and the rings/trees it built; add NCCL_DEBUG_SUBSYS=INIT,NET to keep it short.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
#
# NCCL_SOCKET_IFNAME=ib0 | eth0 | ^lo,docker0
#   The IP interface NCCL uses to bootstrap (and for TCP traffic when there is no InfiniBand). Hosts with
#   several interfaces (docker bridges, a management network) can pick one the other nodes cannot reach:
#   the symptom is a hang in the first collective. Name the interface that routes between your nodes
#   (`ip -br addr`); "^" excludes. GLOO_SOCKET_IFNAME does the same for gloo (CPU runs, and torch's
#   object collectives).
# export NCCL_SOCKET_IFNAME=^lo,docker0
# export GLOO_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME
#
# NCCL_IB_HCA=mlx5_0,mlx5_1,...   (`ibv_devices` lists them)
#   Which InfiniBand/RoCE adapters NCCL may use. By default it uses every one it finds; restrict it when
#   some adapters are on another fabric (storage) or to pin GPU i to its nearest adapter. With RoCE also
#   set NCCL_IB_GID_INDEX (usually 3). NCCL_IB_DISABLE=1 forces TCP: a quick test of whether a hang or
#   a crash comes from the InfiniBand set-up.
# export NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7
#
# Hangs and timeouts (see docs/troubleshooting.md)
#   --distributed-timeout-minutes N bounds every collective: a rank that waits longer fails with an error
#   naming the operation, instead of hanging. TORCH_NCCL_ASYNC_ERROR_HANDLING (torch default 3) makes that
#   error tear the process down so torchrun can restart the job (--max-restarts). TORCH_NCCL_DUMP_ON_TIMEOUT=1
#   with TORCH_FR_BUFFER_SIZE=2000 writes each rank's last collectives (the flight recorder) on a timeout,
#   which shows the rank that is behind.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}
#
# CPU threads: torchrun sets OMP_NUM_THREADS=1 per rank when it is unset; on a CPU-only run give each
# rank (cores / ranks) threads instead.
