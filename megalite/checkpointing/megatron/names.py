"""megatron-core parameter names -> megalite's layout-free keys, for full (un-sharded) tensors.

megalite's tensors are Megatron's: the fused QKV rows are the same per-group interleave
(docs/design.md §3.3), SwiGLU's fc1 is the same [gate; up] stack, and a routed expert's fc1/fc2 are the
same matrices, stacked [E, ...] by megalite. So the mapping is names only, once the tensors are whole:

- both layer specs: the local spec's ``input_layernorm`` / ``pre_mlp_layernorm`` and Transformer
  Engine's fused ``self_attention.linear_qkv.layer_norm_*`` / ``mlp.linear_fc1.layer_norm_*`` (the local
  spec saves its norms under the fused names too);
- per-layer keys ``decoder.layers.{i}.…`` and keys stacked over layers ``decoder.layers.…`` [L, ...];
- experts per key (``mlp.experts.local_experts.{j}.linear_fc1.weight``, grouped
  ``mlp.experts.linear_fc1.weight{j}``) or already stacked [E, ...] (torch_dist's
  ``mlp.experts.experts.linear_fc1.weight`` [L, E, ...]).

``_extra_state`` (Transformer Engine's fp8 metadata) has no megalite counterpart and is skipped.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch

from megalite.checkpointing.errors import CheckpointError
from megalite.checkpointing.stored import all_specs

TOP = {"embedding.word_embeddings.weight": "embedding.word.weight",
       "embedding.position_embeddings.weight": "embedding.position.weight",
       "decoder.final_layernorm.weight": "final_norm.weight", "decoder.final_layernorm.bias": "final_norm.bias",
       "decoder.final_norm.weight": "final_norm.weight", "decoder.final_norm.bias": "final_norm.bias",
       "output_layer.weight": "output_layer.weight"}
LAYER = {"input_layernorm.weight": "input_norm.weight", "input_layernorm.bias": "input_norm.bias",
         "self_attention.linear_qkv.layer_norm_weight": "input_norm.weight",
         "self_attention.linear_qkv.layer_norm_bias": "input_norm.bias",
         "self_attention.linear_qkv.weight": "attention.qkv.weight",
         "self_attention.linear_qkv.bias": "attention.qkv.bias",
         "self_attention.linear_proj.weight": "attention.proj.weight",
         "self_attention.linear_proj.bias": "attention.proj.bias",
         "self_attention.q_layernorm.weight": "attention.q_norm.weight",
         "self_attention.q_layernorm.bias": "attention.q_norm.bias",
         "self_attention.k_layernorm.weight": "attention.k_norm.weight",
         "self_attention.k_layernorm.bias": "attention.k_norm.bias",
         "pre_mlp_layernorm.weight": "pre_mlp_norm.weight", "pre_mlp_layernorm.bias": "pre_mlp_norm.bias",
         "mlp.linear_fc1.layer_norm_weight": "pre_mlp_norm.weight",
         "mlp.linear_fc1.layer_norm_bias": "pre_mlp_norm.bias",
         "mlp.linear_fc1.weight": "mlp.fc1.weight", "mlp.linear_fc1.bias": "mlp.fc1.bias",
         "mlp.linear_fc2.weight": "mlp.fc2.weight", "mlp.linear_fc2.bias": "mlp.fc2.bias",
         "mlp.router.weight": "mlp.router.weight", "mlp.router.expert_bias": "mlp.router.expert_bias",
         "mlp.shared_experts.linear_fc1.weight": "mlp.shared_expert.fc1.weight",
         "mlp.shared_experts.linear_fc1.bias": "mlp.shared_expert.fc1.bias",
         "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.fc2.weight",
         "mlp.shared_experts.linear_fc2.bias": "mlp.shared_expert.fc2.bias"}
EXPERT_KEY = re.compile(r"mlp\.experts\.(?:local_experts\.(?P<j>\d+)\.linear_(?P<a>fc[12])\.weight"
                        r"|linear_(?P<b>fc[12])\.weight(?P<k>\d+)"
                        r"|(?:local_experts\.|experts\.)?linear_(?P<c>fc[12])\.weight)$")
BUFFERS = re.compile(r"\.expert_bias$")  # persistent buffers in megatron-core's state dicts, not parameters
SKIPPED = re.compile(r"(^|\.)_extra_state(/|$)")
# torch_dist's optimizer state in model space, one key per parameter key: the non-distributed optimizer's
# (fp32 copies as fp32_param) and the distributed optimizer's fully_reshardable sharding (fp32 copies as param)
OPTIMIZER_STATE = re.compile(r"^optimizer\.state\.(exp_avg|exp_avg_sq|fp32_param|param)\.(.+)$")
OPTIMIZER_FIELDS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "fp32_param": "main", "param": "main"}
# megatron-core's ChainedOptimizer (an MoE run's dense and expert optimizers) prefixes its optimizers' keys
# with their index unless told not to (Megatron-LM's training loop does, but not for dp_reshardable)
CHAINED = re.compile(r"^chained_\d+\.(?=optimizer\.)")
LAYER_KEY = re.compile(r"^decoder\.layers\.(?:(\d+)\.)?(.+)$")
# multi-token prediction (--mtp-num-layers): megatron-core's mtp.layers.{k}.* -> megalite's (model/mtp.py)
MTP_KEY = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
MTP_OWN = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "final_layernorm": "final_norm"}
# multi-latent attention (--multi-latent-attention): megalite's names are megatron-core's without ``linear_``;
# the latent norms are the local spec's q_layernorm / kv_layernorm, or Transformer Engine's fused into the
# up-projections (``linear_q_up_proj.layer_norm_weight``); the local spec keys its layer norms unfused
MLA_LAYER = {f"self_attention.linear_{n}.weight": f"attention.{n}.weight"
             for n in ("q_proj", "q_down_proj", "q_up_proj", "kv_down_proj", "kv_up_proj")}
MLA_LAYER.update({f"self_attention.{n}_layernorm.{w}": f"attention.{n}_layernorm.{w}"
                  for n in ("q", "kv") for w in ("weight", "bias")})
MLA_LAYER.update({f"self_attention.linear_{n}_up_proj.layer_norm_{w}": f"attention.{n}_layernorm.{w}"
                  for n in ("q", "kv") for w in ("weight", "bias")})
MLA_KEY = re.compile(r"\.self_attention\.linear_kv_down_proj\.weight$")


def split_optimizer_keys(keys: Iterable[str]) -> tuple[list[str], dict[str, dict[str, str]], list[str]]:
    """(model keys, megalite optimizer field -> {model key: its source key}, other optimizer keys):
    ``[chained_<i>.]optimizer.state.exp_avg.<model key>`` is Adam's first moment of that parameter;
    ``optimizer.*`` keys of another layout (the distributed optimizer's flat buffers) are returned apart."""
    model: list[str] = []
    fields: dict[str, dict[str, str]] = {}
    other: list[str] = []
    for key in keys:
        plain = CHAINED.sub("", key)
        m = OPTIMIZER_STATE.match(plain)
        if m:
            field = fields.setdefault(OPTIMIZER_FIELDS[m[1]], {})
            if m[2] in field:
                raise CheckpointError(f"{key}: another optimizer key ({field[m[2]]}) holds this state too")
            field[m[2]] = key
        elif plain.startswith("optimizer."):
            other.append(key)
        else:
            model.append(key)
    return model, fields, other


def _per_layer(key: str, get: Callable[[str], torch.Tensor]) -> Iterable[tuple[int, str, torch.Tensor]]:
    """(layer, suffix, tensor) of one source key: one item per layer of a stacked [L, ...] key."""
    m = LAYER_KEY.match(key)
    assert m is not None
    suffix, t = m.group(2), get(key)
    if m.group(1) is not None:
        yield int(m.group(1)), suffix, t
        return
    for i in range(t.shape[0]):
        yield i, suffix, t[i]


def _expert(suffix: str) -> tuple[str, int | None] | None:
    """(fc1 or fc2, expert index or None for a stacked tensor) of an expert weight's suffix."""
    m = EXPERT_KEY.search(suffix)
    if not m or not suffix.startswith("mlp.experts."):
        return None
    if m.group("a"):
        return m.group("a"), int(m.group("j"))
    if m.group("b"):
        return m.group("b"), int(m.group("k"))
    return m.group("c"), None


def _put(out: dict[str, torch.Tensor], ours: str, t: torch.Tensor, key: str, where: str) -> None:
    """One megalite tensor from one source key: two keys naming the same tensor (both a local-spec and a
    fused norm name, say) are refused rather than one silently winning."""
    if ours in out:
        raise CheckpointError(f"{where}: {key} maps to {ours}, which another key already gave")
    out[ours] = t


def to_megalite(keys: Iterable[str], get: Callable[[str], torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """Full megatron-core tensors (any spec, per-layer or stacked) under megalite's keys; a key that maps
    to nothing is named."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    keys = list(keys)
    names = {**LAYER, **MLA_LAYER} if any(MLA_KEY.search(k) for k in keys) else LAYER  # MLA's q_layernorm
    for key in keys:
        if SKIPPED.search(key):
            continue
        if key in TOP:
            _put(out, TOP[key], get(key), key, where)
            continue
        if (m := MTP_KEY.match(key)) is not None:
            items = [(f"mtp.layers.{m[1]}", m[2], get(key))]
        elif LAYER_KEY.match(key):
            items = [(f"layers.{i}", suffix, t) for i, suffix, t in _per_layer(key, get)]
        else:
            raise CheckpointError(f"{where}: {key} is not a parameter megalite knows")
        for prefix, suffix, t in items:
            head, _, rest = suffix.partition(".")
            if prefix.startswith("mtp.") and head in MTP_OWN:
                _put(out, f"{prefix}.{MTP_OWN[head]}.{rest}", t, key, where)
                continue
            if prefix.startswith("mtp."):
                if head != "transformer_layer":
                    raise CheckpointError(f"{where}: {key} ({suffix}) is not a parameter megalite knows")
                prefix, suffix = f"{prefix}.layer", rest
            if suffix in names:
                _put(out, f"{prefix}.{names[suffix]}", t, key, where)
            elif (e := _expert(suffix)) is not None:
                fc, j = e
                if j is None:
                    _put(out, f"{prefix}.mlp.experts.{fc}_weight", t, key, where)
                else:
                    experts.setdefault((prefix, fc), {})[j] = t
            else:
                raise CheckpointError(f"{where}: {key} ({suffix}) is not a parameter megalite knows")
    for (prefix, fc), per in experts.items():
        if sorted(per) != list(range(len(per))):
            raise CheckpointError(f"{where}: {prefix} has {fc} weights of experts {sorted(per)}, not 0..{len(per)-1}")
        out[f"{prefix}.mlp.experts.{fc}_weight"] = torch.stack([per[j] for j in range(len(per))])
    return out


def _trim_vocab(params: dict[str, torch.Tensor], vocab: int) -> None:
    """Megatron's embedding holds the padded vocabulary; megalite's full tensors the true one."""
    for key in ("embedding.word.weight", "output_layer.weight"):
        t = params.get(key)
        if t is not None and t.shape[0] > vocab:
            params[key] = t[:vocab]


def check_params(params: dict[str, torch.Tensor], config: dict[str, Any], where: str) -> dict[str, torch.Tensor]:
    """The imported tensors are exactly the parameters ``config``'s model has, each of its full shape."""
    if config["untie_embeddings_and_output_weights"] is False:
        params.pop("output_layer.weight", None)  # a tied copy (saved by the last stage of some releases)
    _trim_vocab(params, int(config["vocab_size"]))
    specs = all_specs(config, 1)
    missing, extra = sorted(set(specs) - set(params)), sorted(set(params) - set(specs))
    if missing or extra:
        raise CheckpointError(f"{where}: its tensors do not match the model its args describe (missing "
                              f"{missing[:6]}, unexpected {extra[:6]})")
    expected = full_shapes(config)
    for key in specs:
        if tuple(params[key].shape) != expected[key]:
            raise CheckpointError(f"{where}: {key} has shape {tuple(params[key].shape)}, the model its args "
                                  f"describe needs {expected[key]}")
    return {k: params[k].contiguous() for k in specs}


def full_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Each parameter's full shape: the TP-1 model built on the meta device (true vocab rows)."""
    from megalite.checkpointing.metadata import model_config
    from megalite.model.gpt import GPTModel
    from megalite.parallel.groups import ProcessGroups
    from megalite.parallel.layout import RankLayout
    from megalite.tensor_parallel.context import BuildContext
    from megalite.tensor_parallel.random import RNGTracker

    cfg, vocab = model_config(config)
    ctx = BuildContext(ProcessGroups.unconnected(RankLayout(1, 1, 1), 0), RNGTracker(), device=torch.device("meta"))
    model = GPTModel(cfg, ctx, vocab, layer_numbers=list(range(cfg.num_layers)), pre_process=True, post_process=True)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for key in ("embedding.word.weight", "output_layer.weight"):
        if key in shapes:
            shapes[key] = (vocab, *shapes[key][1:])
    return shapes
