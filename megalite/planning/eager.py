"""The costs of eager, unfused kernels that the bandwidth-bound terms leave out (docs/planning.md, "On this
machine"): on a CPU every operator call costs a fixed dispatch and autograd overhead whatever its bytes,
dropout's keep masks come from a random-number generator slower than memory, and unfused attention's
chain of elementwise kernels passes over its s x s scores more often than the memory-bound term's
"written, read, its gradient written and read" count of the tensors it keeps.

Each term applies only where the device's spec gives its figure (GPUSpec.op_overhead_us,
mask_gelems_per_s, eager_score_passes; elementwise_gbps paces timing.memory_bound_s: the cpu preset's,
measured by bench/measure_cpu.py), so the GPU presets' predictions are untouched: on a GPU these costs
hide behind the launch queue or are fused.
"""

from __future__ import annotations

from megalite.planning.hardware import ClusterConfig
from megalite.planning.kernels import UNFUSED_BACKENDS
from megalite.planning.shape import RunShape

DROPOUT_CALLS = 3  # bernoulli_ into a noise tensor, its in-place division by 1 - p, the multiply
# Passes over each attention score per layer and micro-batch, in bytes per element size, of megalite's
# unfused path (attention/core.py; the QK^T and PV GEMMs are the compute term's): forward the 1/sqrt(d)
# division (read + write), masked_fill (2), softmax (2); backward the division's (2), masked_fill's (2),
# softmax's (reads output and gradient, writes one: 3). With dropout: forward bernoulli_ into an int32
# buffer and its copy to fp32 (3), the division by 1 - p (2), the multiply (3); backward the multiply (3).
SCORE_PASSES, SCORE_DROPOUT_PASSES = 13, 11


def _layer_forward_calls(sh: RunShape) -> int:
    """Autograd operator calls in one transformer layer's forward (model/transformer.py): two norms, four
    linears (QKV, projection, fc1, fc2), the activation (SwiGLU: silu and a multiply), two residual adds,
    the two residual dropouts; the core attention: unfused, K and V repeated to the heads (2), QK^T, the
    scaling, the causal mask (2) and masked_fill, softmax, the attention dropout, PV, and the copy of the
    heads back to [s, b, h]; a fused kernel, one call and that copy."""
    m = sh.cfg.model
    calls = 2 + 4 + (2 if m.gated_linear_unit else 1) + 2 + (2 * DROPOUT_CALLS if m.hidden_dropout > 0 else 0)
    if m.attention_backend in UNFUSED_BACKENDS:
        calls += 2 + 1 + 1 + 2 + 1 + 1 + 1 + 1 + (DROPOUT_CALLS if m.attention_dropout > 0 else 0)
    else:
        calls += 2
    return calls + (2 if m.rotary else 0)


LAYER_PARAMETERS = 12  # tensors per dense layer with biases (2 norms x 2, 4 linears x 2): one accumulation each
MODEL_CALLS = 8  # per micro-batch outside the layers: embedding lookup, position lookup and add, final norm,
# the logits GEMM and the cross-entropy's log-softmax, gather and mean (plus the embedding dropout's below)


def operator_calls(sh: RunShape, stage: int) -> float:
    """Operator calls of one micro-batch on pipeline rank ``stage``, counting a forward call and its
    backward as one (the measured unit): the layers' calls (full recomputation runs their forward again for
    the layers it recomputes, selective the core attention's), the model's own on the first and last stage,
    and one gradient accumulation per parameter tensor."""
    m = sh.cfg.model
    per_layer = _layer_forward_calls(sh)
    again = 8 if sh.recompute == "selective" else per_layer * sh.recomputed_share
    layers = sh.layers_in(stage)
    calls = layers * (per_layer + again / 2 + LAYER_PARAMETERS / 2)
    if stage in (0, sh.loss_rank):
        calls += MODEL_CALLS + (DROPOUT_CALLS if m.hidden_dropout > 0 and stage == 0 else 0) + 2
    return calls


def op_overhead_s(sh: RunShape, cl: ClusterConfig) -> float:
    """The step's operator calls on its busiest pipeline rank, at the device's measured cost per call
    (forward + backward); 0 where the spec gives none (a GPU's launches overlap its kernels)."""
    us = cl.spec().op_overhead_us
    if us is None:
        return 0.0
    return sh.m * max(operator_calls(sh, r) for r in range(sh.pp)) * us * 1e-6


def mask_elements(sh: RunShape, stage: int) -> float:
    """Dropout keep-mask elements one micro-batch draws on pipeline rank ``stage``: per layer the attention
    probabilities' (b·a/t·s/c·s, with --attention-dropout) and the two residual branches' (b·s·h, split by
    TP with SP, with --hidden-dropout), again in a recomputed forward; the embedding's on the first stage."""
    m = sh.cfg.model
    hidden = sh.local_tokens * sh.h / (sh.tp if sh.sp else 1) if m.hidden_dropout > 0 else 0.0
    scores = sh.local_tokens * sh.s * m.num_attention_heads / sh.tp if m.attention_dropout > 0 else 0.0
    again = (1.0, 0.0) if sh.recompute == "selective" else (sh.recomputed_share, sh.recomputed_share)
    if m.attention_backend not in UNFUSED_BACKENDS:  # a fused kernel draws its own masks on the fly
        scores = 0.0
    per_layer = scores * (1 + again[0]) + 2 * hidden * (1 + again[1])
    return sh.layers_in(stage) * per_layer + (hidden if stage == 0 else 0.0)


def dropout_mask_s(sh: RunShape, cl: ClusterConfig) -> float:
    """The step's dropout masks on its busiest pipeline rank at the device's measured bernoulli_ pace; 0
    where the spec gives none (a GPU draws them inside the memory-bound kernels)."""
    rate = cl.spec().mask_gelems_per_s
    if rate is None:
        return 0.0
    return sh.m * max(mask_elements(sh, r) for r in range(sh.pp)) / (rate * 1e9)


def eager_scores_s(sh: RunShape, cl: ClusterConfig) -> float:
    """The unfused attention's passes over its scores beyond the memory-bound term's four per kept byte
    (SCORE_PASSES against the softmax output's 4; with dropout SCORE_DROPOUT_PASSES more against the
    mask's and output's 8), at the elementwise kernels' bandwidth; 0 unless the spec says its kernels run
    eagerly, or with a fused attention kernel."""
    m = sh.cfg.model
    if not cl.spec().eager_score_passes or m.attention_backend not in UNFUSED_BACKENDS:
        return 0.0
    drop = m.attention_dropout > 0
    extra = SCORE_PASSES - 4 + (SCORE_DROPOUT_PASSES - 8 if drop else 0)
    again = 1 if sh.recompute == "selective" else sh.recomputed_share  # the forward's passes again
    fwd = 6 + (8 if drop else 0)
    scores = sh.local_tokens * sh.s * m.num_attention_heads / sh.tp
    per_mb = sh.layers_in(sh.busiest_stage) * scores * (extra + again * fwd) * sh.act_bytes
    return sh.m * per_mb / cl.elementwise_bytes_per_s()
