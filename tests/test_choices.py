"""Tree choices: every accepted form parses to the same tree, the built-ins have their
published sizes, the layout follows DESIGN.md, and every bad input gets its error."""
from __future__ import annotations

import json

import pytest
import torch

from specdec.errors import InputError
from specdec.ops import build_tree_torch
from specdec.drafters.choices import BUILTIN_CHOICES, parse_choices, static_tree, validate_choices

SMALL = [[0], [0, 0], [1], [0, 1], [0, 0, 0]]


def test_docstring_example_layout():
    tree = static_tree([[0], [1], [0, 0]])
    assert tree.choices == ((0,), (1,), (0, 0))
    assert tree.parents.tolist() == [-1, 0, 0, 1]
    assert tree.depth.tolist() == [0, 1, 1, 2]
    assert tree.rank.tolist() == [0, 0, 1, 0]
    assert (tree.num_nodes, tree.max_depth, tree.max_rank) == (4, 2, 1)


@pytest.mark.parametrize("spec", [
    "{0},{0,0},{1},{0,1},{0,0,0}",
    "{{0}, {0, 0}, {1}, {0, 1}, {0, 0, 0}}",
    "  { {0},{0,0} ,\n {1},{0,1},{0,0,0} }  ",
    "[[0], [0, 0], [1], [0, 1], [0, 0, 0]]",
    [(0,), (0, 0), (1,), (0, 1), (0, 0, 0)],
])
def test_every_inline_form_parses_to_the_same_tree(spec):
    assert static_tree(spec).choices == static_tree(SMALL).choices


@pytest.mark.parametrize("name, content", [
    ("list.yaml", "- [0]\n- [0, 0]\n- [1]\n- [0, 1]\n- [0, 0, 0]\n"),  # trtllm-bench's file
    ("block.yml", "- - 0\n- - 0\n  - 0\n- [1]\n- [0, 1]\n- [0, 0, 0]\n"),
    ("keyed.yaml", "medusa_choices: [[0], [0, 0], [1], [0, 1], [0, 0, 0]]\n"),
    ("nested.yaml", "speculative_config:\n  decoding_type: Medusa\n"
                    "  medusa_choices: [[0], [0, 0], [1], [0, 1], [0, 0, 0]]\n"),
    ("string.yaml", "'{0},{0,0},{1},{0,1},{0,0,0}'\n"),
    ("list.json", json.dumps(SMALL)),
])
def test_files_parse_to_the_same_tree(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    assert static_tree(str(path)).choices == static_tree(SMALL).choices


@pytest.mark.parametrize("name, count, depth, max_rank", [
    ("mc_sim_7b_63", 63, 4, 9), ("vicuna_7b_stage2", 63, 4, 9), ("eagle_default_25", 25, 5, 3)])
def test_builtins(name, count, depth, max_rank):
    tree = static_tree(name, top_k=10, max_depth=5)
    assert len(BUILTIN_CHOICES[name]) == count and tree.num_nodes == count + 1
    assert (tree.max_depth, tree.max_rank) == (depth, max_rank)
    # DESIGN.md: parents precede children, siblings in rank order.
    parents, rank = tree.parents.tolist(), tree.rank.tolist()
    assert all(0 <= parents[i] < i for i in range(1, tree.num_nodes))
    for i in range(1, tree.num_nodes):
        siblings = [j for j in range(1, tree.num_nodes) if parents[j] == parents[i]]
        assert [rank[j] for j in siblings] == sorted(rank[j] for j in siblings)
    for i, choice in enumerate(tree.choices, start=1):
        assert tree.depth[i] == len(choice) and rank[i] == choice[-1]
        assert choice[:-1] == (tree.choices[parents[i] - 1] if parents[i] > 0 else ())


def test_buffers_are_built_once_per_device_and_match_build_tree():
    tree = static_tree("mc_sim_7b_63")
    buffers = tree.buffers("cpu")
    assert tree.buffers(torch.device("cpu")) is buffers
    n = tree.num_nodes
    expected = build_tree_torch(tree.parents.view(1, n), torch.tensor([n]), torch.tensor([0]))
    assert torch.equal(buffers.tree_mask, expected.tree_mask)
    assert torch.equal(buffers.depth[0], tree.depth)
    assert torch.equal(buffers.positions, buffers.depth)


@pytest.mark.parametrize("spec, top_k, max_depth, message", [
    ([], None, None, "choices must not be empty"),
    ("[]", None, None, "choices must not be empty"),
    ([[0], [0]], None, None, r"choices: \[0\] appears twice"),
    ([[0], [0, 1, 0]], None, None, r"\[0, 1, 0\] needs its prefix \[0, 1\], which is missing"),
    ([[1]], None, None, None),  # a lone second-best candidate is a valid tree
    ([[0], [0, 4]], 4, None, r"\[0, 4\] uses top-k index 4; indices must be < top_k = 4"),
    ([[0], [0, 0]], None, 1, r"\[0, 0\] has depth 2; at most 1"),
    ([[0], []], None, None, "a choice is empty"),
    ([[0], [-1]], None, None, r"\[-1\] holds a negative index"),
    ([[0], [0.5]], None, None, "every choice must be a list of ints"),
    ([[0], "01"], None, None, "every choice must be a list of ints"),
    ([[True]], None, None, "every choice must be a list of ints"),
    (7, None, None, "choices must be a list of index lists, got int"),
    ("mc_sim_7b_64", None, None, "'mc_sim_7b_64' is not a built-in tree"),
    ("[[0], [1]", None, None, "cannot parse .* as JSON"),
    ("{0},{1", None, None, r"cannot parse .* as \{0,0\},\{0,1\} lists"),
    ("/nonexistent/tree.yaml", None, None, "file /nonexistent/tree.yaml does not exist"),
    ("mc_sim_7b_63", 8, None, r"uses top-k index 8; indices must be < top_k = 8"),
    ("eagle_default_25", None, 4, r"has depth 5; at most 4"),
])
def test_validation_errors(spec, top_k, max_depth, message):
    if message is None:
        static_tree(spec, top_k=top_k, max_depth=max_depth)
        return
    with pytest.raises(InputError, match=message):
        static_tree(spec, top_k=top_k, max_depth=max_depth)


def test_yaml_errors(tmp_path):
    unkeyed = tmp_path / "unkeyed.yaml"
    unkeyed.write_text("speculative_config:\n  max_draft_len: 63\n")
    with pytest.raises(InputError, match="holds a mapping without a medusa_choices or choices key"):
        static_tree(str(unkeyed))
    broken = tmp_path / "broken.yaml"
    broken.write_text("- [0\n")
    with pytest.raises(InputError, match="cannot read"):
        static_tree(str(broken))


def test_parse_keeps_order_and_validate_is_separate():
    assert parse_choices("{1},{0}") == [(1,), (0,)]
    validate_choices([(1,), (0,)], top_k=2, max_depth=1)
    assert static_tree("{1},{0}").choices == ((0,), (1,))
