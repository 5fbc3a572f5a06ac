"""Parallel layout flags."""

from __future__ import annotations

from dataclasses import dataclass

from megalite.config.domain import MAX_RANKS, at_least, positive, size
from megalite.config.flags import option
from megalite.config.moe import MAX_LAYERS
from megalite.parallel.placement import LayerSplit
from megalite.parallel.stage_layout import parse_layout

# --cp-comm-type's values, under the names the attention code uses; CP_COMM_SPELLINGS maps the other
# spellings accepted (megatron-core / Transformer Engine write all_gather) to them.
CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")
CP_COMM_SPELLINGS = {"all_gather": "allgather"}


def normalise_cp_comm_type(name: str) -> str:
    """The one internal name of a --cp-comm-type value (an unknown one is returned as is: validate names it)."""
    return CP_COMM_SPELLINGS.get(name, name)


@dataclass(kw_only=True)
class ParallelConfig:
    """Parallelism: how ranks split the model and the batch."""

    tensor_model_parallel_size: int = option(1, help="Tensor-parallel size: ranks that split each layer.",
                                             domain=size(MAX_RANKS))
    pipeline_model_parallel_size: int = option(1, help="Pipeline-parallel size: stages the layers are cut into.",
                                               domain=size(MAX_RANKS))
    num_layers_per_virtual_pipeline_stage: int | None = option(
        None, help="Layers per virtual stage for the interleaved 1F1B schedule (even splits only: with "
        "--decoder-first/last-pipeline-num-layers give --num-virtual-stages-per-pipeline-rank instead, as "
        "Megatron-LM).", domain=size(MAX_LAYERS))
    num_virtual_stages_per_pipeline_rank: int | None = option(
        None, help="Model chunks per pipeline rank for the interleaved 1F1B schedule (Megatron-LM's flag; "
        "exclusive with --num-layers-per-virtual-pipeline-stage).", domain=size(MAX_LAYERS))
    decoder_first_pipeline_num_layers: int | None = option(
        None, help="Transformer layers of the first pipeline stage (Megatron-LM's uneven split); the stages "
        "without a given count split the rest evenly. With --num-virtual-stages-per-pipeline-rank v, divisible "
        "by v (each of the rank's chunks holds 1/v). Under --pipeline-schedule zbv: the layers of the V's first "
        "virtual stage (rank 0's chunk 0), the other 2p - 2 virtual stages splitting the rest.",
        domain=at_least(0, MAX_LAYERS))
    decoder_last_pipeline_num_layers: int | None = option(
        None, help="Transformer layers of the last pipeline stage, as --decoder-first-pipeline-num-layers; under "
        "--pipeline-schedule zbv those of the V's last virtual stage (rank 0's chunk 1, with the loss).",
        domain=at_least(0, MAX_LAYERS))
    account_for_embedding_in_pipeline_split: bool = option(
        False, help="Count the embedding as one layer of an even split: the first virtual stage holds one "
        "transformer layer fewer (--num-layers + 1 divisible by the virtual stages). Exclusive with "
        "--decoder-first/last-pipeline-num-layers.")
    account_for_loss_in_pipeline_split: bool = option(
        False, help="Count the loss (final norm, output layer) as one layer of an even split: the last virtual "
        "stage holds one transformer layer fewer. Exclusive with --decoder-first/last-pipeline-num-layers.")
    pipeline_model_parallel_layout: str | None = option(
        None, help="Every virtual stage's layers as a string (Megatron-LM's syntax): stages separated by |, in "
        "pipeline order (round-robin: chunk 0 of every rank, then chunk 1; zbv: down the V and back up), E the "
        "embedding (opening the first stage), t a transformer layer, L the loss (closing the last stage), x*N and "
        "(...)*N repeat, commas cosmetic, e.g. \"E|t*3|t*3|tL\". The stage count / "
        "--pipeline-model-parallel-size gives the chunks per rank; m (MTP) is refused. Exclusive with the other "
        "split flags.")
    pipeline_schedule: str = option(
        "1f1b", help="Pipeline schedule: 1f1b (interleaved 1F1B when virtual stages are used), gpipe (for "
        "comparison), zb-h1 (zero bubble: each backward split into the input gradient B and the weight "
        "gradients W, the W's filling 1F1B's waits at 1F1B's activation memory; about a third of 1F1B's "
        "bubble) or zbv (zero bubble on two model chunks per rank placed in a V, the loss on the first rank; "
        "needs --num-layers divisible by 2 x --pipeline-model-parallel-size; a tied embedding's two copies "
        "are then on the first rank). Under both, B computes the input gradients (and those of norms, "
        "biases, embeddings and the router) and W the linear layers', the output layer's and the experts' "
        "weight gradients.",
        choices=["1f1b", "gpipe", "zb-h1", "zbv"])
    record_pipeline_timeline: str | None = option(
        None, help="Write each rank's forward/backward start/end times of the last step to this directory "
        "(JSON; plot with tools/plot_pipeline_timeline.py).")
    context_parallel_size: int = option(
        1, help="Context-parallel size: ranks that split each sequence (2 x size chunks, rank r keeps chunks r "
        "and 2 x size - 1 - r so causal attention costs the same everywhere). Gradients are reduced over "
        "data x context parallel ranks.", domain=size(MAX_RANKS))
    cp_comm_type: list[str] = option(
        ["p2p"], help="How context-parallel attention communicates, one value for every layer or one per layer "
        "(--num-layers values, as Megatron-LM): p2p (ring attention: K/V chunks passed around the CP ring, "
        "overlapped with the block computation), a2a (all-to-all to head-sharded full sequences; each "
        "tensor-parallel rank's heads and query groups must be divisible by the CP size), allgather or "
        "all_gather (gather K/V, keep queries local) or a2a+p2p (an all-to-all inside groups of the first "
        "--hierarchical-context-parallel-sizes ranks, then the ring over the rest).",
        choices=[*CP_COMM_TYPES, *CP_COMM_SPELLINGS], scalar=True)
    hierarchical_context_parallel_sizes: list[int] | None = option(
        None, help="Sizes of the levels of hierarchical context parallelism, multiplying to "
        "--context-parallel-size (Megatron-LM's flag): the first is the all-to-all group (that many consecutive "
        "CP ranks, inside a node), the ring of a2a+p2p runs over the product of the others (the CP ranks with "
        "the same index in their all-to-all group). Needed by --cp-comm-type a2a+p2p; given without it, the "
        "groups are built and unused, as in Megatron-LM.", domain=size(MAX_RANKS))
    expert_model_parallel_size: int = option(
        1, help="Expert-parallel size: ranks that split each MoE layer's experts, taken from the data-parallel "
        "(and context-parallel) ranks of a stage, as in Megatron-LM. Expert gradients are reduced over the "
        "remaining expert-data-parallel ranks.", domain=size(MAX_RANKS))
    expert_tensor_parallel_size: int | None = option(
        None, help="Ranks that split each expert's hidden size (default: --tensor-model-parallel-size; 1: whole "
        "experts). Expert-TP x EP must divide the ranks of a pipeline stage.", domain=size(MAX_RANKS))
    sequence_parallel: bool = option(False, help="Shard norm/dropout activations along the sequence (needs TP>1).")
    rank_order: str = option("tp-cp-dp-pp", help="Rank layout order, leftmost axis varies fastest.",
                             choices=["tp-cp-dp-pp", "tp-cp-pp-dp"])
    use_tp_pp_dp_mapping: bool = option(
        False, help="Megatron's alternative rank order tp-cp-pp-dp (pipeline stages inside a node, data "
        "parallelism outermost) instead of --rank-order.")
    hierarchical_dp_reduce: bool = option(
        False, help="Reduce gradients over data parallelism in three steps: reduce-scatter inside each node, "
        "all-reduce of the shard across nodes, all-gather inside the node (same sum; 1/k of the inter-node "
        "bytes with k DP ranks per node). Nodes are LOCAL_WORLD_SIZE consecutive ranks.")
    print_layout: bool = option(
        False, help="Rank 0 prints which ranks form which TP/DP/PP group on which node at start-up "
        "(tools/show_layout.py prints the same without a run).")
    distributed_timeout_minutes: float = option(
        10.0, help="Timeout of every collective and of the rendezvous (ranks still missing then are named), "
        "in minutes; fractions allowed.", domain=positive(hi=10**6))

    def __post_init__(self) -> None:
        # one value stands for every layer; every spelling becomes its one internal name
        types = [self.cp_comm_type] if isinstance(self.cp_comm_type, str) else list(self.cp_comm_type)
        self.cp_comm_type = [normalise_cp_comm_type(t) if isinstance(t, str) else t for t in types]
        if self.hierarchical_context_parallel_sizes is not None:
            self.hierarchical_context_parallel_sizes = list(self.hierarchical_context_parallel_sizes)

    def layer_cp_comm_types(self, num_layers: int) -> tuple[str, ...]:
        """The comm type of every layer (0-based): one value repeated, or the per-layer list as given
        (validate refuses any other length)."""
        types = self.cp_comm_type
        return tuple(types) * num_layers if len(types) == 1 else tuple(types)

    def virtual_stages(self, num_layers: int) -> int:
        """v: model chunks per pipeline rank (ZB-V: two, in a V; a layout: its stages / p); never raises, so
        validation may ask before the rules hold (an unreadable layout counts as one chunk)."""
        pp = self.pipeline_model_parallel_size
        if self.pipeline_schedule == "zbv":
            return 2
        if self.pipeline_model_parallel_layout is not None:
            try:
                stages = len(parse_layout(self.pipeline_model_parallel_layout))
            except ValueError:
                return 1
            return max(stages // pp, 1) if pp > 0 else 1
        if self.num_virtual_stages_per_pipeline_rank is not None:
            return max(self.num_virtual_stages_per_pipeline_rank, 1)
        k = self.num_layers_per_virtual_pipeline_stage
        return max(num_layers // (pp * k), 1) if k and k > 0 and pp > 0 else 1

    def layer_split(self, num_layers: int) -> LayerSplit:
        """How the layers are cut over the virtual stages (parallel/placement.py); a layout string that does
        not parse raises ValueError (validation reports it first)."""
        layout = self.pipeline_model_parallel_layout
        return LayerSplit(num_layers, self.pipeline_model_parallel_size, self.virtual_stages(num_layers),
                          self.pipeline_schedule == "zbv", self.decoder_first_pipeline_num_layers,
                          self.decoder_last_pipeline_num_layers, self.account_for_embedding_in_pipeline_split,
                          self.account_for_loss_in_pipeline_split, parse_layout(layout) if layout else None)

    @property
    def layout_order(self) -> str:
        """The rank order the layout is built with."""
        return "tp-cp-pp-dp" if self.use_tp_pp_dp_mapping else self.rank_order
