"""Fixtures shared by every test module."""

from __future__ import annotations

import pytest

from megalite.parallel.groups import NCCL_SEMANTICS_ENV

# The longest files (their multi-rank launches) first, longest first: scripts/test.sh runs two workers that
# each take whole files in collection order, so that the run ends on short files, not on one worker still
# busy with a long one while the other idles. Measured with --durations on 2 cores (this round's new files
# placed by their launches); order only, no limit.
LONG_FIRST = ("test_soak.py", "test_hf_family_gemma2.py", "test_hf_family_gemma3.py",
              "test_hf_family_deepseek_v3.py", "test_hf_family_mistral.py",
              "test_sliding_window_training.py", "test_hf_family_llama.py",
              "test_sliding_window.py", "test_moe_training.py", "test_cli_layouts.py", "test_sharding.py",
              "test_context_parallel_training.py",
              "test_bad_inputs_entry_points.py", "test_cli_context_parallel.py", "test_pipeline_parallel.py",
              "test_operations.py", "test_memory_features.py", "test_failure_reporting.py", "test_multinode.py",
              "test_hf_conversion.py", "test_checkpoint.py", "test_convert_checkpoint.py", "test_moe_checkpoint.py",
              "test_data_parallel.py", "test_planning_moe.py", "test_planning.py", "test_topology.py",
              "test_deepspeed_config.py", "test_fused_kernels.py", "test_training_layouts.py",
              "test_hf_family_olmo2.py", "test_hf_family_qwen3_moe.py", "test_hf_family_qwen2.py",
              "test_megatron_export_families.py", "test_megatron_window.py", "test_megatron_qk_layernorm.py",
              "test_hf_family_qwen3.py", "test_checkpoint_writers.py", "test_zero_bubble_training.py",
              "test_attn_softcap.py", "test_moe_group_routing.py", "test_rope_yarn.py", "test_mla.py", "test_mtp.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Collection order: the files of LONG_FIRST first, in its order; every other file after, as collected."""
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="module", params=["gloo", "nccl_semantics"])
def p2p_semantics(request):
    """Run a test twice: on plain gloo, and with MEGALITE_NCCL_SEMANTICS=1 (NCCL's point-to-point and
    communicator rules emulated on gloo). Module-scoped, so the module's shared runs are redone in each mode;
    the harness and the CLI helpers hand the variable to the ranks they start. For the cheap tests; the
    long multi-rank ones run every layout under NCCL semantics and one also on plain gloo
    (tests/layouts.py), or, where no layout is special, everything under NCCL semantics (``nccl_semantics``)."""
    patch = pytest.MonkeyPatch()
    if request.param == "nccl_semantics":
        patch.setenv(NCCL_SEMANTICS_ENV, "1")
    else:
        patch.delenv(NCCL_SEMANTICS_ENV, raising=False)
    yield request.param
    patch.undo()


@pytest.fixture
def nccl_semantics(monkeypatch):
    """MEGALITE_NCCL_SEMANTICS=1 for the ranks the test starts: NCCL's rules are stricter than gloo's, and the
    numbers are the same, so a multi-rank run that passes here needs no plain-gloo twin."""
    monkeypatch.setenv(NCCL_SEMANTICS_ENV, "1")
