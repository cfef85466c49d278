"""Static tree choices (Medusa / EAGLE-1) as plain data, turned once into a `StaticTree`.

A choice is the path of top-k indices from the root to one draft node: [0, 1] is the
second-best candidate of head 2 following the best candidate of head 1. Owns parsing
(every form below), validation (one InputError naming the problem) and the per-node
arrays the drafters and ops need. Does not own tokens or models.

Accepted forms of a `choices` spec:
- a built-in name: `mc_sim_7b_63` (Medusa's default), `vicuna_7b_stage2` (Medusa-2,
  Vicuna-7B), `eagle_default_25` (EAGLE-1's default tree, which EAGLE's own code also
  calls mc_sim_7b_63);
- TensorRT-LLM's string form `{0,0,0},{0,1}`, with or without outer braces/whitespace;
- JSON: `[[0],[0,0],[1]]`;
- a path to a YAML (or JSON) file holding a list of lists, as trtllm-bench's
  `--medusa_choices` file, or a mapping with it under `medusa_choices` / `choices`
  (also nested under `speculative_config` or `decoding_config`);
- a sequence of sequences of ints.

    choices [[0], [1], [0, 0]]  ->  node  0  1  2  3     (node 0: the root)
                                    parents -1  0  0  1
                                    depth    0  1  1  2
                                    rank     0  0  1  0
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from ..errors import InputError
from ..ops.tree_mask import TreeBuffers, build_tree_torch

Choice = tuple[int, ...]

# Medusa, medusa/model/medusa_choices.py: the 63-node default tree.
MC_SIM_7B_63 = (
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4],
    [2, 0], [0, 5], [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8],
    [0, 0, 2], [3, 0], [0, 9], [8], [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0],
    [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0],
    [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2],
    [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0],
    [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0],
)

# Medusa, medusa/model/medusa_choices.py: the tree tuned for Medusa-2 Vicuna-7B.
VICUNA_7B_STAGE2 = (
    [0], [0, 0], [1], [0, 1], [0, 0, 0], [1, 0], [2], [0, 2], [0, 0, 1], [0, 3], [3],
    [0, 1, 0], [2, 0], [4], [0, 0, 2], [0, 4], [1, 1], [1, 0, 0], [0, 0, 0, 0], [5],
    [0, 0, 3], [0, 5], [0, 2, 0], [3, 0], [0, 1, 1], [0, 6], [6], [0, 7], [0, 0, 4], [4, 0],
    [1, 2], [0, 8], [7], [0, 3, 0], [0, 0, 0, 1], [0, 0, 5], [2, 1], [0, 0, 6], [1, 0, 1],
    [0, 0, 1, 0], [2, 0, 0], [5, 0], [0, 9], [0, 1, 2], [8], [0, 4, 0], [0, 2, 1], [1, 3],
    [0, 0, 7], [0, 0, 0, 2], [0, 0, 8], [1, 1, 0], [0, 1, 0, 0], [6, 0], [9], [0, 1, 3],
    [0, 0, 0, 3], [1, 0, 2], [0, 5, 0], [3, 1], [0, 0, 2, 0], [7, 0], [1, 4],
)

# EAGLE, eagle/model/choices.py (named mc_sim_7b_63 there): EAGLE-1's 25-node tree.
EAGLE_DEFAULT_25 = (
    [0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
    [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
)

BUILTIN_CHOICES: dict[str, tuple[list[int], ...]] = {
    "mc_sim_7b_63": MC_SIM_7B_63,
    "vicuna_7b_stage2": VICUNA_7B_STAGE2,
    "eagle_default_25": EAGLE_DEFAULT_25,
}

_YAML_KEYS = ("medusa_choices", "choices")
_YAML_SECTIONS = ("speculative_config", "decoding_config")


@dataclass(frozen=True, eq=False)
class StaticTree:
    """A validated static tree; node 0 is the root, node i > 0 is choices[i - 1]."""

    choices: tuple[Choice, ...]  # sorted by (depth, lexicographic), as Medusa sorts them
    parents: torch.Tensor  # [N] int64, N = len(choices) + 1; parents[0] = -1
    depth: torch.Tensor  # [N] int64: len(choice); 0 for the root
    rank: torch.Tensor  # [N] int64: top-k index among the parent's candidates (choice[-1])
    max_depth: int  # deepest choice (the number of heads / draft steps it needs)
    max_rank: int  # largest top-k index used (top_k needed = max_rank + 1)
    _buffers: dict = field(default_factory=dict, repr=False, compare=False)
    _nodes: dict = field(default_factory=dict, repr=False, compare=False)  # device -> (parents, depth, rank)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def num_nodes(self) -> int:
        return len(self.choices) + 1

    def buffers(self, device: Union[str, torch.device] = "cpu") -> TreeBuffers:
        """Tree buffers of this tree as a batch of one ([1, N, ...]) on `device`, built
        once per device; positions are relative (prefix_len 0): add the prefix length."""
        device = torch.device(device)
        with self._lock:
            if device not in self._buffers:
                n = self.num_nodes
                cpu = build_tree_torch(self.parents.view(1, n), torch.tensor([n]),
                                       torch.zeros(1, dtype=torch.int64))
                self._buffers[device] = TreeBuffers(
                    **{name: getattr(cpu, name).to(device) for name in
                       ("tree_mask", "positions", "depth", "first_child", "next_sibling")})
            return self._buffers[device]

    def nodes(self, device: Union[str, torch.device] = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(parents, depth, rank) [N] on `device`, copied once per device (a drafter's
        step reads them without a host-to-device copy)."""
        device = torch.device(device)
        with self._lock:
            if device not in self._nodes:
                self._nodes[device] = (self.parents.to(device), self.depth.to(device), self.rank.to(device))
            return self._nodes[device]


def _parse_braces(text: str) -> Any:
    """TensorRT-LLM's `{0,0,0},{0,1}` (optionally `{{...}}`) -> nested lists."""
    try:
        data = json.loads("[" + text.replace("{", "[").replace("}", "]") + "]")
    except json.JSONDecodeError as exc:
        raise InputError(f"choices: cannot parse {text!r} as {{0,0}},{{0,1}} lists: {exc.msg}")
    if len(data) == 1 and isinstance(data[0], list) and data[0] and all(
            isinstance(c, list) for c in data[0]):
        data = data[0]  # outer braces
    return data


def _from_yaml_file(path: Path) -> Any:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise InputError(f"choices: cannot read {path}: {exc}")
    if isinstance(data, dict):
        for section in (data, *(data.get(s) for s in _YAML_SECTIONS)):
            if isinstance(section, dict):
                for key in _YAML_KEYS:
                    if key in section:
                        return section[key]
        raise InputError(f"choices: {path} holds a mapping without a "
                         f"{' or '.join(_YAML_KEYS)} key")
    if isinstance(data, str):
        return parse_choices(data)
    return data


def parse_choices(spec: Union[str, Sequence[Sequence[int]]]) -> list[Choice]:
    """Any accepted form (see the module docstring) -> list of choice tuples, in the
    given order, checked for shape only (lists of non-negative ints); see
    `validate_choices` for the tree rules."""
    if isinstance(spec, str):
        text = spec.strip()
        if text in BUILTIN_CHOICES:
            data: Any = BUILTIN_CHOICES[text]
        elif text.startswith("{"):
            data = _parse_braces(text)
        elif text.startswith("["):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise InputError(f"choices: cannot parse {text!r} as JSON: {exc.msg}")
        elif text.lower().endswith((".yaml", ".yml", ".json")) or Path(text).is_file():
            path = Path(text).expanduser()
            if not path.is_file():
                raise InputError(f"choices: file {text} does not exist")
            data = _from_yaml_file(path)
        else:
            raise InputError(f"choices: {text!r} is not a built-in tree "
                             f"({', '.join(BUILTIN_CHOICES)}), a {{0,0}},{{0,1}} string, "
                             "a JSON list or a YAML file")
    else:
        data = spec
    if isinstance(data, (str, bytes)) or not isinstance(data, Sequence):
        raise InputError(f"choices must be a list of index lists, got {type(data).__name__}")
    out = []
    for item in data:
        if (isinstance(item, (str, bytes)) or not isinstance(item, Sequence)
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in item)):
            raise InputError(f"choices: every choice must be a list of ints, got {item!r}")
        if len(item) == 0:
            raise InputError("choices: a choice is empty; the root is implicit, list only "
                             "draft nodes")
        if any(i < 0 for i in item):
            raise InputError(f"choices: {list(item)} holds a negative index")
        out.append(tuple(item))
    return out


def validate_choices(choices: Sequence[Choice], top_k: Optional[int] = None,
                     max_depth: Optional[int] = None) -> None:
    """Raises one InputError naming the first problem: no choices, a duplicate, a
    missing prefix, an index >= top_k, or a path deeper than max_depth (None: no limit)."""
    if len(choices) == 0:
        raise InputError("choices must not be empty")
    seen: set[Choice] = set()
    for c in choices:
        if c in seen:
            raise InputError(f"choices: {list(c)} appears twice")
        seen.add(c)
    for c in choices:
        if max_depth is not None and len(c) > max_depth:
            raise InputError(f"choices: {list(c)} has depth {len(c)}; at most {max_depth} "
                             "(the number of draft heads / draft depth)")
        if top_k is not None and max(c) >= top_k:
            raise InputError(f"choices: {list(c)} uses top-k index {max(c)}; indices must "
                             f"be < top_k = {top_k}")
        for cut in range(1, len(c)):
            if c[:cut] not in seen:
                raise InputError(f"choices: {list(c)} needs its prefix {list(c[:cut])}, "
                                 "which is missing")


def static_tree(spec: Union[str, Sequence[Sequence[int]]], top_k: Optional[int] = None,
                max_depth: Optional[int] = None) -> StaticTree:
    """Parses, validates and lays out a tree: choices sorted by (depth, lexicographic),
    so parents precede children and siblings appear in rank order (DESIGN.md)."""
    choices = parse_choices(spec)
    validate_choices(choices, top_k=top_k, max_depth=max_depth)
    ordered = tuple(sorted(choices, key=lambda c: (len(c), c)))
    node_of = {c: i + 1 for i, c in enumerate(ordered)}
    parents = [-1] + [node_of[c[:-1]] if len(c) > 1 else 0 for c in ordered]
    return StaticTree(
        choices=ordered,
        parents=torch.tensor(parents, dtype=torch.int64),
        depth=torch.tensor([0] + [len(c) for c in ordered], dtype=torch.int64),
        rank=torch.tensor([0] + [c[-1] for c in ordered], dtype=torch.int64),
        max_depth=max(len(c) for c in ordered),
        max_rank=max(max(c) for c in ordered))
