"""Prompt lookup (drafters/lookup.py): the n-gram index finds what a brute-force scan
finds, and a grafted tree is a tree that holds the branch within its node limit."""
from __future__ import annotations

import random

import pytest
import torch

from specdec.drafters.base import DraftTree
from specdec.drafters.lookup import NgramIndex, graft


def scan(tokens: list[int], length: int, max_ngram: int = 3, min_ngram: int = 2) -> list[int]:
    """The reference: the latest earlier occurrence of the longest n-gram ending the text,
    found by scanning; its continuation repeats with the occurrence's period."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(tokens) <= n:
            continue
        for p in range(len(tokens) - 2, n - 2, -1):
            if tokens[p - n + 1: p + 1] == tokens[-n:]:
                period = len(tokens) - 1 - p
                return [tokens[p + 1 + (j % period)] for j in range(length)]
    return []


@pytest.mark.parametrize("seed", range(20))
def test_index_finds_what_a_scan_finds_as_the_text_grows(seed):
    rng = random.Random(seed)
    vocab = rng.choice((3, 5, 12))  # small vocabularies repeat n-grams often
    tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
    index = NgramIndex()
    found = 0
    while len(tokens) < 80:
        length = rng.randrange(1, 12)
        got = index.continuation(tokens, length)
        assert got == scan(tokens, length), tokens
        found += bool(got)
        tokens += [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]  # a step emits 1-3 tokens
    assert found > 0


def test_a_repeating_text_is_predicted_to_go_on_repeating():
    text = [7, 8, 9] * 3 + [7, 8]
    assert NgramIndex().continuation(text, 7) == [9, 7, 8, 9, 7, 8, 9]
    assert NgramIndex().continuation([1, 2, 3, 4], 5) == []  # no n-gram occurs twice
    assert NgramIndex(min_ngram=1).continuation([5, 1, 6, 1], 2) == [6, 1]


def random_tree(rng: random.Random, n: int, vocab: int) -> DraftTree:
    """A tree in topological order whose siblings carry distinct tokens, as drafters' do."""
    tokens, parents = [rng.randrange(vocab)], [-1]  # the root's token is the engine's, any value
    used: dict[int, set] = {}
    while len(tokens) < n:
        p = rng.randrange(len(tokens))
        free = [t for t in range(vocab) if t not in used.setdefault(p, set())]
        if not free:
            continue
        t = rng.choice(free)
        used[p].add(t)
        tokens.append(t)
        parents.append(p)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents))


def root_path(tokens: list[int], parents: list[int], chain: list[int]) -> list[int]:
    """The nodes of the path from the root that spells `chain`'s first tokens."""
    node, path = 0, []
    for t in chain:
        nxt = [i for i in range(1, len(tokens)) if parents[i] == node and tokens[i] == t]
        if not nxt:
            break
        node = nxt[0]
        path.append(node)
    return path


def graft_reference(tokens: list[int], parents: list[int], chain: list[int]) -> tuple[list[int], list[int]]:
    """graft's twin in lists: keep the longest prefix of the tree's nodes that leaves room
    for the chain's nodes that prefix does not already spell, then append those."""
    path = root_path(tokens, parents, chain)
    n = len(tokens)
    for keep in range(n, 0, -1):
        shared = len([node for node in path if node < keep])
        if keep + len(chain) - shared <= n:
            break
    new_tokens, new_parents = tokens[:keep], parents[:keep]
    attach = path[shared - 1] if shared else 0
    for t in chain[shared:]:
        new_tokens.append(t)
        new_parents.append(attach)
        attach = len(new_tokens) - 1
    return new_tokens, new_parents


@pytest.mark.parametrize("seed", range(300))
def test_graft_equals_its_list_twin_and_holds_the_branch_in_the_same_nodes(seed):
    rng = random.Random(seed)
    vocab = rng.choice((2, 4, 50))
    tree = random_tree(rng, rng.randrange(2, 20), vocab)
    n = tree.num_nodes
    chain = [rng.randrange(vocab) for _ in range(rng.randrange(1, n))]
    if rng.random() < 0.2:  # a chain the tree already spells, in part or whole
        chain = [tree.tokens[i].item() for i in reversed(ancestry(tree.parents.tolist(), rng.randrange(1, n)))]
    out = graft(tree, torch.tensor(chain))
    tokens, parents = out.tokens.tolist(), out.parents.tolist()
    assert (tokens, parents) == graft_reference(tree.tokens.tolist(), tree.parents.tolist(), chain)
    assert len(tokens) == n  # the step verifies as many nodes as were drafted
    assert parents[0] == -1 and all(0 <= parents[i] < i for i in range(1, n))
    # siblings stay distinct: sampling's verification treats each node as its own proposal
    assert len({(p, t) for p, t in zip(parents[1:], tokens[1:])}) == n - 1
    assert len(root_path(tokens, parents, chain)) == len(chain)  # the whole branch is there


def ancestry(parents: list[int], node: int) -> list[int]:
    """`node` and its ancestors below the root, deepest first."""
    out = []
    while node > 0:
        out.append(node)
        node = parents[node]
    return out


def test_graft_shares_the_nodes_the_tree_already_has():
    # root -> 5 -> 6 and root -> 9, then 7 under 9
    tree = DraftTree(torch.tensor([0, 5, 9, 6, 7]), torch.tensor([-1, 0, 0, 1, 2]))
    out = graft(tree, torch.tensor([5, 6, 8]))  # follows 5 -> 6, adds 8 in the last node's place
    assert out.tokens.tolist() == [0, 5, 9, 6, 8] and out.parents.tolist() == [-1, 0, 0, 1, 3]
    out = graft(tree, torch.tensor([5, 1, 2]))  # branches off below 5 in the last two nodes' place
    assert out.tokens.tolist() == [0, 5, 9, 1, 2] and out.parents.tolist() == [-1, 0, 0, 1, 3]
    out = graft(tree, torch.tensor([9, 7]))  # already there
    assert torch.equal(out.tokens, tree.tokens) and torch.equal(out.parents, tree.parents)
    out = graft(tree, torch.tensor([1, 2, 3, 4]))  # nothing shared: the branch alone
    assert out.tokens.tolist() == [0, 1, 2, 3, 4] and out.parents.tolist() == [-1, 0, 1, 2, 3]
