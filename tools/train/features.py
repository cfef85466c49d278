"""The target's features on the training conversations, computed once and cached.

Every drafter learns from the frozen target, and the target's forward is most of the
cost of a training step on a CPU. So it runs once per conversation, and its outputs
are kept on disk (float16, memory-mapped) for every epoch and every drafter:

    hidden [N, H]   the final, post-norm hidden state (EAGLE-1's feature; the target's
                    logits are `lm_head(hidden)`)
    aux    [N, 3H]  the inputs of EAGLE-3's three feature layers (low, middle, high)
    ids    [N]      the tokens

N counts the tokens of all conversations back to back; `offsets[i]` is where
conversation i starts and `prompt_lens[i]` how many of its tokens are the prompt
(system + user turn + assistant prefix): losses are taken on the answer only.
A rerun with the same conversations, target and batch layout reuses the cache; one with
more conversations appended after the cached ones keeps their rows and computes the rest
(a later training round), and the earlier round's conversations alone still read theirs.
Any other set of conversations (new ones sorted in between, some dropped) copies the rows
of every conversation the cache holds, found by its content (`digests.npy`: one digest of
target and tokens per conversation), and computes only the others.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "backend_src"))
from specdec.kv_cache import AttentionBatch  # noqa: E402
from specdec.models.eagle3 import eagle3_feature_layers  # noqa: E402
from specdec.models.layers import causal_mask  # noqa: E402
from specdec.models.llama import LlamaModel  # noqa: E402

TOKENS_PER_FORWARD = 4096  # a forward's padded batch x length: big matmuls, bounded memory


@dataclass
class FeatureSet:
    ids: np.ndarray  # [N] int32
    hidden: np.ndarray  # [N, H] float16 (memory-mapped)
    aux: np.ndarray  # [N, 3H] float16 (memory-mapped)
    offsets: np.ndarray  # [C + 1] int64: conversation c is tokens offsets[c]:offsets[c+1]
    prompt_lens: np.ndarray  # [C] int64

    @property
    def num_conversations(self) -> int:
        return len(self.prompt_lens)

    def conversation(self, c: int) -> slice:
        return slice(int(self.offsets[c]), int(self.offsets[c + 1]))

    def answer_tokens(self, conversations=None) -> int:
        cs = range(self.num_conversations) if conversations is None else conversations
        return int(sum(self.offsets[c + 1] - self.offsets[c] - self.prompt_lens[c] for c in cs))


def _target_digest(base_dir: Path):
    """sha256 over the target's weights (not how they were made): every key starts from it."""
    digest = hashlib.sha256()
    with (base_dir / "model.safetensors").open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest


def _key(conversations: list[list[int]], target_digest) -> str:
    digest = target_digest.copy()
    for ids in conversations:
        digest.update(np.asarray(ids, dtype=np.int32).tobytes())
        digest.update(b"|")
    return digest.hexdigest()


def _digests(conversations: list[list[int]], target_digest) -> np.ndarray:
    """[C] bytes: one digest per conversation of the target's weights and its tokens."""
    out = np.zeros(len(conversations), dtype="S16")
    for c, ids in enumerate(conversations):
        digest = target_digest.copy()
        digest.update(np.asarray(ids, dtype=np.int32).tobytes())
        out[c] = digest.digest()[:16]
    return out


def _reuse_by_content(cache_dir: Path, meta: dict, digests: np.ndarray, offsets: np.ndarray, H: int,
                      log=print) -> np.ndarray | None:
    """Writes a new cache for `digests`' conversations (rows at `offsets`) with the rows of
    every one the old cache computed, found by digest; returns which were found (done),
    or None where the old cache cannot say (no digests: it predates them, or is empty)."""
    index = [cache_dir / name for name in ("digests.npy", "lengths.npy", "done.npy")]
    if not (all(path.is_file() for path in index) and meta.get("tokens")):
        return None
    old_digests, lengths, old_done = (np.load(path) for path in index)
    if not len(old_digests) == len(lengths) == len(old_done) == meta.get("conversations"):
        return None
    old_offsets = np.zeros(len(old_digests) + 1, dtype=np.int64)
    old_offsets[1:] = lengths.cumsum()
    where = {d: c for c, d in enumerate(old_digests.tolist()) if old_done[c]}
    found = np.array([d in where for d in digests.tolist()], dtype=bool)
    if not found.any():
        return None
    N = int(offsets[-1])
    for name, width in (("hidden", H), ("aux", 3 * H)):
        old = np.load(cache_dir / f"{name}.npy", mmap_mode="r")
        new = np.lib.format.open_memmap(cache_dir / f"{name}.reuse.npy", mode="w+", dtype=np.float16,
                                        shape=(N, width))
        for c in np.flatnonzero(found):
            o = where[digests[c]]
            new[offsets[c]: offsets[c + 1]] = old[old_offsets[o]: old_offsets[o + 1]]
        new.flush()
        del new, old
    # The old index goes first: a run stopped between the two renames finds no index and
    # computes everything, never reads rows by an index that no longer describes them.
    for path in (cache_dir / "meta.json", *index):
        path.unlink()
    for name in ("hidden", "aux"):
        (cache_dir / f"{name}.reuse.npy").replace(cache_dir / f"{name}.npy")
    log(f"features: reusing the rows of {int(found.sum())} of {len(digests)} conversations from the cache "
        f"of {len(old_digests)}")
    return found


def _write_index(cache_dir: Path, digests: np.ndarray, offsets: np.ndarray) -> None:
    np.save(cache_dir / "digests.npy", digests)
    np.save(cache_dir / "lengths.npy", np.diff(offsets))


def _extends(meta: dict, conversations: list[list[int]], target_digest) -> bool:
    """Whether the cached conversations are the first ones of `conversations` (a later
    training round appends its new data after the old): their rows are then kept."""
    m = meta.get("conversations", 0)
    return 0 < m < len(conversations) and _key(conversations[:m], target_digest) == meta.get("key")


def _is_earlier_round(meta: dict, key: str, count: int, done_path: Path) -> bool:
    """Whether `key` names the first `count` conversations of the cache, which a later
    round extended (`meta["earlier"]`), all of them computed."""
    if not any(e["key"] == key and e["conversations"] == count for e in meta.get("earlier", [])):
        return False
    return done_path.is_file() and bool(np.load(done_path)[:count].all())


def _grow(cache_dir: Path, old_rows: int, rows: int, H: int) -> None:
    """Rewrites hidden.npy and aux.npy with `rows` rows, the first `old_rows` copied."""
    for name, width in (("hidden", H), ("aux", 3 * H)):
        path = cache_dir / f"{name}.npy"
        old = np.load(path, mmap_mode="r")
        assert old.shape == (old_rows, width), (path, old.shape)
        tmp = cache_dir / f"{name}.grow.npy"
        new = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=(rows, width))
        for start in range(0, old_rows, 1 << 16):
            stop = min(start + (1 << 16), old_rows)
            new[start: stop] = old[start: stop]
        new.flush()
        del new, old
        tmp.replace(path)


def base_forward(base: LlamaModel, ids: torch.Tensor, aux_layers) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, T] (right-padded) -> (hidden [B, T, H], aux [B, T, 3H]); causal, no cache reuse."""
    B, T = ids.shape
    cache = base.new_cache(B, T)
    batch = AttentionBatch.build(torch.arange(B), torch.zeros(B, dtype=torch.long), causal_mask(B, T, ids.device))
    with torch.no_grad():
        return base(ids, torch.arange(T)[None].expand(B, T), cache, batch, aux_layers)


def build_features(conversations: list[list[int]], prompt_lens: list[int], base_dir: Path, cache_dir: Path,
                   log=print) -> FeatureSet:
    """Computes (or reuses) the target's features for `conversations` in `cache_dir`."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    target_digest = _target_digest(base_dir)
    key = _key(conversations, target_digest)
    meta_path = cache_dir / "meta.json"
    offsets = np.zeros(len(conversations) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(c) for c in conversations])
    N = int(offsets[-1])
    base = LlamaModel.from_pretrained(base_dir)
    H = base.shape.hidden_size
    aux_layers = eagle3_feature_layers(base.shape.num_hidden_layers)
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    mode = "r+" if meta.get("key") == key else "w+"
    done_path = cache_dir / "done.npy"
    ids_all = np.concatenate([np.asarray(c, dtype=np.int32) for c in conversations]) if conversations else \
        np.zeros(0, dtype=np.int32)
    prompt_lens = np.asarray(prompt_lens, dtype=np.int64)
    if mode == "w+" and _is_earlier_round(meta, key, len(conversations), done_path):
        # this run's conversations are the first ones of the cache's (an earlier round's data): read-only views
        hidden = np.load(cache_dir / "hidden.npy", mmap_mode="r")[:N]
        aux = np.load(cache_dir / "aux.npy", mmap_mode="r")[:N]
        log(f"features: the first {len(conversations)} conversations of a later round's cache")
        return FeatureSet(ids_all, hidden, aux, offsets, prompt_lens)
    digests = _digests(conversations, target_digest)
    if mode == "w+" and _extends(meta, conversations, target_digest):
        log(f"features: extending the cache of {meta['conversations']} conversations to {len(conversations)}")
        _grow(cache_dir, int(meta["tokens"]), N, H)
        done = np.zeros(len(conversations), dtype=bool)
        if done_path.is_file():
            old_done = np.load(done_path)
            done[: len(old_done)] = old_done
        np.save(done_path, done)
        earlier = meta.get("earlier", []) + [{k: meta[k] for k in ("key", "tokens", "conversations")}]
        meta_path.write_text(json.dumps({"key": key, "tokens": N, "conversations": len(conversations),
                                         "earlier": earlier}) + "\n")
        _write_index(cache_dir, digests, offsets)
        mode = "r+"
    if mode == "w+":
        found = _reuse_by_content(cache_dir, meta, digests, offsets, H, log)
        if found is not None:
            np.save(done_path, found)
            meta_path.write_text(json.dumps({"key": key, "tokens": N, "conversations": len(conversations)}) + "\n")
            _write_index(cache_dir, digests, offsets)
            mode = "r+"
    hidden = np.lib.format.open_memmap(cache_dir / "hidden.npy", mode=mode, dtype=np.float16, shape=(N, H))
    aux = np.lib.format.open_memmap(cache_dir / "aux.npy", mode=mode, dtype=np.float16, shape=(N, 3 * H))
    done = np.load(done_path) if mode == "r+" and done_path.is_file() else np.zeros(len(conversations), dtype=bool)
    if mode == "w+":
        np.save(done_path, done)  # before the new meta: an old cache's flags must not pass for this one's
        meta_path.write_text(json.dumps({"key": key, "tokens": N, "conversations": len(conversations)}) + "\n")
        _write_index(cache_dir, digests, offsets)
    elif not (cache_dir / "digests.npy").is_file():  # a cache from before the digests: give it them
        _write_index(cache_dir, digests, offsets)
    order = sorted((i for i in range(len(conversations)) if not done[i]), key=lambda i: len(conversations[i]))
    t0, computed = time.time(), 0
    while order:
        T = len(conversations[order[-1]])
        group = [order.pop()]
        while order and (len(group) + 1) * T <= TOKENS_PER_FORWARD:
            group.append(order.pop())
        ids = torch.zeros(len(group), T, dtype=torch.long)
        for row, c in enumerate(group):
            ids[row, : len(conversations[c])] = torch.tensor(conversations[c])
        h, a = base_forward(base, ids, aux_layers)
        for row, c in enumerate(group):
            n = len(conversations[c])
            hidden[offsets[c]: offsets[c] + n] = h[row, :n].to(torch.float16).numpy()
            aux[offsets[c]: offsets[c] + n] = a[row, :n].to(torch.float16).numpy()
            done[c] = True
        computed += sum(len(conversations[c]) for c in group)
        if computed and (time.time() - t0) > 0:
            hidden.flush()
            aux.flush()
            np.save(done_path, done)
            log(f"features: {int(done.sum())}/{len(conversations)} conversations, "
                f"{computed / (time.time() - t0):.0f} tok/s")
    hidden.flush()
    aux.flush()
    np.save(done_path, done)
    return FeatureSet(ids_all, hidden, aux, offsets, prompt_lens)
