"""A tiny model family written at test time: a base model and a drafter of every kind
whose drafts the base accepts often, but not always.

Owns: writing the family into a directory in the upstream layouts the engine's loaders
read (`base/` and `draft/`: Hugging Face Llama; `eagle/`: EAGLE-1's head; `eagle3/`:
EAGLE-3's head with `d2t`/`t2d`; `medusa/`: `medusa_lm_head.safetensors`) over
SmolLM2's tokenizer (vocabulary 49152, bos 1, eos 2), and `tiny_family()`, the copy
one test process shares. Does not own: what any test asserts about it.

Why it is built and not random: tests assert that speculation happens (τ > 1, fewer
target forwards than tokens, drafted and accepted counts that move), and random
drafters of a random base accept almost nothing; trained ones take hours on a GPU. So
the weights that decide tokens are set by hand, and the rest is random and small.

The base is a successor table with a memory of the recent past:
- Active tokens S: the first `ACTIVE` distinct tokens of a short Python function
  (`ACTIVE_TEXT`). The hidden state's dims hold, for each active token, a *token* dim
  (which token this is) and a *recency* dim (how much of the recent context it is),
  then a few free dims and one *bias* dim:

      dims  [0, K)  token    [K, 2K)  recency    [2K, H - 1)  free    H - 1  bias

  An active token's embedding is its token dim plus the bias dim; any other token's is
  a random direction over the token and free dims plus the bias dim; all have RMS 1.
- `lm_head` (not tied) reads the token dims: each active token has four successors in
  S with logits 8, 7, 6, 5 (`SUCCESSOR_LOGITS`; the first successors form one cycle
  through S); other active tokens get 0 and the rest of the vocabulary -20 (through the
  bias dim), so greedy and sampled text stay in S. It reads the recency dims with
  weight -`PENALTY`: a token is less likely the more of the recent context it is.
- Layer 0's attention fills the recency dims: its queries and keys are constant (read
  from the bias dim) on RoPE's 0.01-radian frequency pair only, so it attends to the
  last ~`WINDOW` positions with Gaussian weights, whatever they hold; its values are
  the token dims. Greedy decoding thus follows the first successor unless it was used
  recently, so the text runs through much of S instead of repeating a few tokens, and
  its next token depends on the context. Every other attention and MLP weight is
  random with outputs scaled down (`NOISE`), so the residual stream stays close to the
  current embedding (and the context flips a choice now and then, too).

The drafters know the table but see the recent context only as it was:
- EAGLE-1: `fc` passes the embedding half through on the token and bias dims and the
  base feature's recency dims (the context as of the feature's position); one layer
  with a small random output; the base `lm_head` turns its output into logits.
- EAGLE-3: `fc` averages the two copies of the layer-2 input (the features of layers
  (2, 2, 1) of a four-layer base), which carry the recency dims. The midlayer's
  residual is the previous token's state, so the new token enters through attention:
  queries and keys are constant on every RoPE pair (rope_theta 10, where
  sum_p cos(d theta_p) / 8 <= 0.87 for any distance d in 1..1500), so a position
  attends mostly to itself (`SELF_ATTENTION` sets how much leaks to the previous ones),
  and its value, normed embedding minus normed residual on the token and bias dims,
  swaps the previous token for the new one. Its `lm_head` is the base's rows for the
  draft vocabulary S, which `d2t`/`t2d` map into the full vocabulary.
- Medusa: head k (proposing position t + 2 + k) is the base `lm_head` after k + 1 steps
  of the first-successor map (a permutation of the token dims), behind a small random
  residual block.
- Draft model: the base with its random weights perturbed (`DRAFT_NOISE`) and its
  recency penalty at `DRAFT_PENALTY` of its strength.
A draft is wrong where tokens drafted (or accepted) after the drafter's view of the
context change the penalty enough to flip a choice, or where the random parts do; the
deeper the draft, the likelier. Measured when written (float32, the first six HumanEval
prompts, 48 new tokens, the engine's default trees): the base takes a first successor
on about two steps in three; τ 3.9 EAGLE-1, 3.6 EAGLE-2, 3.3 EAGLE-3, 2.4 Medusa, 3.3
draft model (acceptance rate 0.56 of a 4-token chain). `tests/test_tiny_family.py`
keeps every method's τ in range and its acceptance rate below 0.9.
"""
from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

VOCAB, BOS, EOS = 49152, 1, 2
H, LAYERS, HEADS, KV_HEADS, INTER = 64, 4, 4, 2, 128
HEAD_DIM = H // HEADS
ACTIVE = 28  # K: 2K + 1 <= H, with a few free dims left for the other tokens
MEDUSA_HEADS = 4
SUCCESSOR_LOGITS = (8.0, 7.0, 6.0, 5.0)  # an active token's successors, best first
INACTIVE_LOGIT = -20.0
COS = 0.9  # an embedding's share along its token direction; the rest is the bias dim
PENALTY = 20.0  # logits taken from a token that is all of the recent context
WINDOW = 8.0  # the recency attention's Gaussian width, in positions
RECENCY_PAIR = 4  # the RoPE pair (of HEAD_DIM / 2) the recency attention uses: 0.01 rad
NOISE = 0.14  # scale of every random attention and MLP output
DRAFT_PENALTY = 0.8
DRAFT_NOISE = 0.3
EAGLE_NOISE = 0.15
MEDUSA_NOISE = 0.05
SELF_ATTENTION = 20.0  # EAGLE-3's self-attention score; 0.13 of it separates distance 1
EAGLE3_ROPE_THETA = 10.0
SEED = 0
# the base's generation_config.json recommends a sampling, as many checkpoints' do: the OpenAI
# front door's default for a request that sets none (tools/openai_frontend/sampling_defaults.py)
BASE_SAMPLING = {"temperature": 0.7, "top_p": 0.8}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
ACTIVE_TEXT = '''def below_threshold(numbers: list, limit: int) -> bool:
    """Return True if all numbers in the list are below the limit."""
    for value in numbers:
        if value >= limit:
            return False
    return True
'''
_SCALE = H ** 0.5  # an RMS-1 vector's norm
_SIN = (1 - COS ** 2) ** 0.5


@lru_cache(maxsize=1)
def tiny_family() -> Path:
    """The family, written once per process into a temporary directory (removed at exit)."""
    directory = Path(tempfile.mkdtemp(prefix="specdec-tiny-family-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return write_tiny_family(directory)


def write_tiny_family(directory: Path, tokenizer_dir: Path | None = None) -> Path:
    """Writes base/, draft/, eagle/, eagle3/ and medusa/ into `directory`; tokenizer
    files from `tokenizer_dir` (default: SmolLM2's, `tools/family.py`)."""
    if tokenizer_dir is None:
        import family
        tokenizer_dir = family.BASE_DIR
    directory = Path(directory)
    gen = torch.Generator().manual_seed(SEED)
    active = active_tokens(tokenizer_dir)
    successors = _successors(gen)
    lm_head = _lm_head(active, successors)
    base = _base_state(_embeddings(active, gen), lm_head, gen)
    _write_llama(directory / "base", base, tokenizer_dir)
    generation = json.loads((directory / "base" / "generation_config.json").read_text())
    generation.update(do_sample=True, **BASE_SAMPLING)
    (directory / "base" / "generation_config.json").write_text(json.dumps(generation, indent=2))
    _write_llama(directory / "draft", _draft_state(base, gen), tokenizer_dir)
    _write_eagle(directory / "eagle", gen)
    _write_eagle3(directory / "eagle3", active, lm_head, gen)
    _write_medusa(directory / "medusa", lm_head, successors[:, 0], gen)
    return directory


def active_tokens(tokenizer_dir: Path) -> torch.Tensor:
    """[ACTIVE] ids: the first distinct tokens of ACTIVE_TEXT in order of appearance."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    special = set(tok.get_added_tokens_decoder())
    ids = [i for i in dict.fromkeys(tok.encode(ACTIVE_TEXT, add_special_tokens=False).ids) if i not in special]
    if len(ids) < ACTIVE:
        raise ValueError(f"ACTIVE_TEXT has {len(ids)} distinct tokens, fewer than {ACTIVE}")
    return torch.tensor(ids[:ACTIVE])


def _successors(gen: torch.Generator) -> torch.Tensor:
    """[K, len(SUCCESSOR_LOGITS)] active-token indices: column 0 walks all K tokens in
    one cycle, the others are random, distinct within a row and never the token itself."""
    K = ACTIVE
    order = torch.randperm(K, generator=gen)
    first = torch.empty(K, dtype=torch.long)
    first[order] = order.roll(-1)
    rows = []
    for x in range(K):
        row = [int(first[x])]
        while len(row) < len(SUCCESSOR_LOGITS):
            c = int(torch.randint(0, K, (1,), generator=gen))
            if c != x and c not in row:
                row.append(c)
        rows.append(row)
    return torch.tensor(rows)


def _embeddings(active: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """[VOCAB, H], every row of RMS 1 (see the module docstring's dims)."""
    K = ACTIVE
    direction = torch.randn(VOCAB, H - 1, generator=gen)
    direction[:, K: 2 * K] = 0.0  # the recency dims are the attention's to write
    direction[active] = 0.0
    direction[active, torch.arange(K)] = 1.0
    direction = direction / direction.norm(dim=-1, keepdim=True)
    return torch.cat((COS * _SCALE * direction, torch.full((VOCAB, 1), _SIN * _SCALE)), dim=-1)


def _lm_head(active: torch.Tensor, successors: torch.Tensor) -> torch.Tensor:
    """[VOCAB, H]. For a final hidden state equal to active token x's embedding:
    SUCCESSOR_LOGITS[j] for x's successor j, 0 for the other active tokens,
    INACTIVE_LOGIT for the rest; minus PENALTY x the recency dim of each active token."""
    K = ACTIVE
    head = torch.zeros(VOCAB, H)
    head[:, H - 1] = INACTIVE_LOGIT / (_SIN * _SCALE)
    head[active, H - 1] = 0.0
    for j, logit in enumerate(SUCCESSOR_LOGITS):
        head[active[successors[:, j]], torch.arange(K)] = logit / (COS * _SCALE)
    head[active, K + torch.arange(K)] = -PENALTY / (COS * _SCALE)
    return head


def _normal(gen: torch.Generator, *shape: int, std: float) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * std


def _random_layer(gen: torch.Generator, prefix: str, noise: float, in_features: int = H,
                  kv_heads: int = KV_HEADS) -> dict[str, torch.Tensor]:
    """A Llama layer's attention and MLP, random, their outputs about `noise` per dim
    for inputs of RMS 1 (norm weights 1)."""
    kv = kv_heads * HEAD_DIM
    return {
        f"{prefix}self_attn.q_proj.weight": _normal(gen, H, in_features, std=in_features ** -0.5),
        f"{prefix}self_attn.k_proj.weight": _normal(gen, kv, in_features, std=in_features ** -0.5),
        f"{prefix}self_attn.v_proj.weight": _normal(gen, kv, in_features, std=in_features ** -0.5),
        f"{prefix}self_attn.o_proj.weight": _normal(gen, H, H, std=noise * H ** -0.5),
        f"{prefix}mlp.gate_proj.weight": _normal(gen, INTER, H, std=H ** -0.5),
        f"{prefix}mlp.up_proj.weight": _normal(gen, INTER, H, std=H ** -0.5),
        f"{prefix}mlp.down_proj.weight": _normal(gen, H, INTER, std=2 * noise * INTER ** -0.5),
        f"{prefix}post_attention_layernorm.weight": torch.ones(H),
    }


def _recency_attention(prefix: str, strength: float) -> dict[str, torch.Tensor]:
    """Layer 0's attention: every head attends to the last ~WINDOW positions (constant
    queries and keys on one RoPE pair: score (a^2 / 2) cos(0.01 d) for distance d, a
    Gaussian in d near 0) and adds `strength` x the tokens' share of that window to the
    recency dims (value: the token dims; KV head 0 carries tokens [0, 16), head 1 the rest)."""
    K, theta = ACTIVE, 10000.0 ** (-2 * RECENCY_PAIR / HEAD_DIM)
    a = 2 / (theta * WINDOW)  # weight exp(-(a theta d / 2)^2) = exp(-(d / WINDOW)^2)
    q = torch.zeros(H, H)
    k = torch.zeros(KV_HEADS * HEAD_DIM, H)
    for rows, heads in ((q, HEADS), (k, KV_HEADS)):
        for h in range(heads):
            for dim in (RECENCY_PAIR, RECENCY_PAIR + HEAD_DIM // 2):
                rows[h * HEAD_DIM + dim, H - 1] = a / (_SIN * _SCALE)
    v = torch.zeros(KV_HEADS * HEAD_DIM, H)
    o = torch.zeros(H, H)
    heads_per_kv = HEADS // KV_HEADS
    for t in range(K):
        kv_head, dim = divmod(t, HEAD_DIM)
        v[kv_head * HEAD_DIM + dim, t] = 1.0 / (COS * _SCALE)
        o[K + t, kv_head * heads_per_kv * HEAD_DIM + dim] = strength  # the first query head of the group
    return {f"{prefix}self_attn.q_proj.weight": q, f"{prefix}self_attn.k_proj.weight": k,
            f"{prefix}self_attn.v_proj.weight": v, f"{prefix}self_attn.o_proj.weight": o}


def _base_state(embed: torch.Tensor, lm_head: torch.Tensor, gen: torch.Generator) -> dict[str, torch.Tensor]:
    state = {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head, "model.norm.weight": torch.ones(H)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        state.update(_random_layer(gen, p, NOISE))
        state[p + "input_layernorm.weight"] = torch.ones(H)
    # Recency dim of token t: COS x H ** 0.5 x its share of the window, which lm_head's
    # -PENALTY / (COS x H ** 0.5) turns into -PENALTY logits at share 1.
    state.update(_recency_attention("model.layers.0.", COS * _SCALE))
    return state


def _draft_state(base: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The base with its random weights perturbed (relative noise DRAFT_NOISE) and its
    recency penalty at DRAFT_PENALTY of its strength."""
    draft = dict(base)
    for key, w in base.items():
        if key.startswith("model.layers.0.self_attn."):
            continue
        if key.endswith("_proj.weight"):
            draft[key] = w + _normal(gen, *w.shape, std=DRAFT_NOISE * float(w.std()))
    draft["model.layers.0.self_attn.o_proj.weight"] = DRAFT_PENALTY * base["model.layers.0.self_attn.o_proj.weight"]
    return draft


def _llama_config(**kw) -> dict:
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB, hidden_size=H,
               intermediate_size=INTER, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
               num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, hidden_act="silu", max_position_embeddings=2048,
               rms_norm_eps=1e-5, rope_theta=10000.0, attention_bias=False, mlp_bias=False,
               tie_word_embeddings=False, bos_token_id=BOS, eos_token_id=EOS)
    cfg.update(kw)
    return cfg


def _write_llama(directory: Path, state: dict[str, torch.Tensor], tokenizer_dir: Path) -> None:
    """Hugging Face layout, written by transformers itself."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = _llama_config()
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"}))
    model.load_state_dict(state, strict=True)
    model.save_pretrained(directory, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, directory / name)


def _write_eagle(directory: Path, gen: torch.Generator) -> None:
    from specdec.models.eagle import EagleHead
    from specdec.models.layers import LlamaShape

    K = ACTIVE
    cfg = _llama_config(num_hidden_layers=1, bias=True)
    state = _random_layer(gen, "layers.0.", EAGLE_NOISE)
    fc = torch.zeros(H, 2 * H)
    fc[:, :H] = torch.eye(H)  # the embedding: token, free and bias dims
    fc[K: 2 * K, H + K: H + 2 * K] = torch.eye(K)  # the feature's recency dims
    state["fc.weight"] = fc + _normal(gen, H, 2 * H, std=EAGLE_NOISE * (2 * H) ** -0.5)
    state["fc.bias"] = torch.zeros(H)
    state["embed_tokens.weight"] = torch.zeros(VOCAB, H)  # not written: the base's are used
    head = EagleHead(LlamaShape.from_config(cfg))
    head.load_state_dict(state, strict=True)
    head.save_pretrained(directory, cfg, dtype=torch.float32)


def _write_eagle3(directory: Path, active: torch.Tensor, lm_head: torch.Tensor, gen: torch.Generator) -> None:
    from specdec.models.eagle3 import Eagle3Head
    from specdec.models.layers import LlamaShape

    K = ACTIVE
    cfg = _llama_config(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, num_key_value_heads=HEADS,
                        rope_theta=EAGLE3_ROPE_THETA, draft_vocab_size=K, target_hidden_size=H, bias=False)
    p = "midlayer."
    state = {k: v for k, v in _random_layer(gen, p, EAGLE_NOISE, 2 * H, HEADS).items() if ".mlp." in k}  # small
    eye, small = torch.eye(H), EAGLE_NOISE * (2 * H) ** -0.5
    # fc: the mean of the two layer-2 inputs (features (2, 2, 1) of four layers).
    state["fc.weight"] = torch.cat((eye / 2, eye / 2, torch.zeros(H, H)), dim=1) + _normal(gen, H, 3 * H, std=small)
    # Queries and keys: one constant per dim (the normed embedding's bias dim), so
    # RoPE alone decides the score: SELF_ATTENTION at distance 0, 0.87 of it at most elsewhere.
    qk = torch.zeros(H, 2 * H)
    qk[:, H - 1] = (SELF_ATTENTION * HEAD_DIM ** 0.5 / HEAD_DIM) ** 0.5 / (_SIN * _SCALE)
    state[p + "self_attn.q_proj.weight"] = qk + _normal(gen, H, 2 * H, std=small)
    state[p + "self_attn.k_proj.weight"] = qk + _normal(gen, H, 2 * H, std=small)
    # Values: the new token's normed embedding minus the normed residual, on the token,
    # free and bias dims; the residual's recency dims pass.
    swap = torch.eye(H)
    swap[K: 2 * K, K: 2 * K] = 0.0
    state[p + "self_attn.v_proj.weight"] = torch.cat((swap, -swap), dim=1) + _normal(gen, H, 2 * H, std=small)
    state[p + "self_attn.o_proj.weight"] = eye + _normal(gen, H, H, std=small)
    for name in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
        state[f"{p}{name}.weight"] = torch.ones(H)
    state["norm.weight"] = torch.ones(H)
    state["lm_head.weight"] = lm_head[active].clone()
    state["d2t"] = active - torch.arange(K)
    state["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)
    state["t2d"][active] = True
    state["embed_tokens.weight"] = torch.zeros(VOCAB, H)  # not written: the base's are used
    head = Eagle3Head(LlamaShape.from_config(cfg), K, H)
    head.load_state_dict(state, strict=True)
    head.save_pretrained(directory, cfg, dtype=torch.float32)


def _write_medusa(directory: Path, lm_head: torch.Tensor, first: torch.Tensor, gen: torch.Generator) -> None:
    from specdec.models.medusa import MedusaHeads

    K = ACTIVE
    step = torch.eye(H)  # one first-successor step on the token dims: e_x -> e_first(x)
    step[:K, :K] = 0.0
    step[first, torch.arange(K)] = 1.0
    state, power = {}, step
    for i in range(MEDUSA_HEADS):
        state[f"{i}.0.linear.weight"] = _normal(gen, H, H, std=MEDUSA_NOISE * H ** -0.5)
        state[f"{i}.0.linear.bias"] = torch.zeros(H)
        state[f"{i}.1.weight"] = lm_head @ power
        power = step @ power
    heads = MedusaHeads(H, VOCAB, MEDUSA_HEADS, 1)
    heads.load_state_dict(state, strict=True)
    heads.save_pretrained(directory, {"medusa_num_heads": MEDUSA_HEADS, "medusa_num_layers": 1,
                                      "base_model_name_or_path": "../base", "hidden_size": H,
                                      "vocab_size": VOCAB}, dtype=torch.float32)
