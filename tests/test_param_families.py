"""Promise (megalite/tensor_parallel/param_meta.py): a parameter's family names the groups it is cut, split,
averaged and counted over, and everything else follows the metadata: no code in megalite/ outside the MoE
package and the metadata module branches on whether a parameter is a routed expert's (in any spelling:
``.expert``, ``is_expert``, ``kind == "expert"``, the EXPERT family itself ...). The families resolve to the
groups and checkpoint folders the layout gives them (the folder names of older checkpoints)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from megalite.checkpointing.paths import family_dirname
from megalite.parallel.groups import Group, ProcessGroups
from megalite.parallel.layout import RankLayout
from megalite.tensor_parallel.param_meta import DENSE, EXPERT, FAMILIES, model_families

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "megalite"
EXEMPT = {PKG / "moe", PKG / "tensor_parallel" / "param_meta.py"}  # the MoE package and the metadata
NAMES = {"expert", "is_expert", "has_experts", "experts_sharded", "EXPERT", "expert_dirname"}
STRINGS = {"expert", "experts", "routed"}


def expert_branches(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, spelling) of every name or comparison that singles routed experts' parameters out."""
    found = []
    for node in ast.walk(tree):
        name = (node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else
                node.arg if isinstance(node, ast.keyword | ast.arg) else
                node.name if isinstance(node, ast.FunctionDef | ast.alias) else None)
        if isinstance(node, ast.alias):
            name = (node.asname or node.name).split(".")[-1]
        if name in NAMES:
            found.append((node.lineno if hasattr(node, "lineno") else 0, name))
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                if isinstance(side, ast.Constant) and isinstance(side.value, str) and side.value.lower() in STRINGS:
                    found.append((node.lineno, f"== {side.value!r}"))
    return found


def test_no_expert_branch_outside_the_moe_package_and_the_metadata():
    offences = []
    for path in sorted(PKG.rglob("*.py")):
        if any(path == e or e in path.parents for e in EXEMPT):
            continue
        for line, spelling in expert_branches(ast.parse(path.read_text(), str(path))):
            offences.append(f"{path.relative_to(ROOT)}:{line}: {spelling}")
    assert not offences, "expert branches outside megalite/moe and param_meta.py (use ParamMeta.family):\n" + \
        "\n".join(offences)


def test_the_scan_finds_each_spelling():
    src = ("if param_meta(p).expert: pass\nif reader.is_expert(k): pass\nif kind == 'expert': pass\n"
           "from megalite.tensor_parallel.param_meta import EXPERT\nf(expert=True)\n")
    assert sorted(expert_branches(ast.parse(src))) == [
        (1, "expert"), (2, "is_expert"), (3, "== 'expert'"), (4, "EXPERT"), (5, "expert")]


@pytest.mark.parametrize("rank", range(8))
def test_families_resolve_to_the_layouts_groups(rank):
    """World 8 = DP 4 x TP 2 with EP 2: experts cut over expert-TP 2 (= TP), split over EP 2, averaged
    over expert-DP 2; dense weights cut over TP, averaged over DP 4."""
    pg = ProcessGroups.unconnected(RankLayout(8, 2, 1, ep=2), rank)
    assert DENSE.dp_kind(pg) == pg.grad_kind and DENSE.coords(pg) == (pg.tp_rank, 2)
    assert DENSE.split_coords(pg) == (0, 1) and EXPERT.split_coords(pg) == (pg.ep_rank, 2)
    assert EXPERT.dp_kind(pg) == Group.EDP and pg.size(Group.EDP) == 2 and EXPERT.coords(pg) == (pg.etp_rank, 2)
    assert DENSE.reduced_over(pg, sharded=True) == [Group.MP, pg.grad_kind]
    assert EXPERT.reduced_over(pg, sharded=False) == [Group.EMP, Group.PP]
    full = torch.arange(8).view(4, 2)
    assert torch.equal(EXPERT.block(full, 1, 2), full[2:]) and DENSE.block(full, 1, 2) is full


def test_families_keep_the_checkpoint_folder_names():
    assert family_dirname(DENSE, 1, 0, 3) == "mp_rank_01_003"
    assert family_dirname(EXPERT, 1, 2, 3) == "expert_rank_01_002_003"
    assert list(FAMILIES.values()) == [DENSE, EXPERT] == model_families(True) and model_families(False) == [DENSE]
