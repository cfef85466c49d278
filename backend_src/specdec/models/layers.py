"""Llama building blocks shared by the target model and the EAGLE heads.

Module and parameter names mirror Hugging Face's Llama (`self_attn.q_proj`,
`mlp.gate_proj`, `input_layernorm`, ...) so upstream state dicts load unchanged.
Attention either runs over the forward's own tokens only (training, `cache=None`)
or writes into and reads from a `KVCache` slot (serving).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..kv_cache import AttentionBatch, KVCache
from . import cpu_attention, cpu_layer_ops


@dataclass(frozen=True)
class LlamaShape:
    """The parts of a Llama-family `config.json` the forward needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    max_position_embeddings: int
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2: always)
    tie_word_embeddings: bool

    @staticmethod
    def from_config(cfg: dict) -> "LlamaShape":
        model_type = cfg.get("model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2"):
            raise ConfigError(f"model_type {model_type!r} is not a Llama-family model "
                              f"(supported: llama, mistral, qwen2)")
        heads = cfg["num_attention_heads"]
        rope_scaling = cfg.get("rope_scaling") or None
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:  # transformers 5 nests RoPE settings under rope_parameters
            params = cfg.get("rope_parameters") or {}
            rope_theta = params.get("rope_theta", 10000.0)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        return LlamaShape(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = cpu_layer_ops.kernel_for(x, self.weight)
        if kernel is not None:  # one call on the CPU (models/cpu_layer_ops.py); this code is its twin
            return kernel.rms_norm(x.contiguous(), self.weight.contiguous(), self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(shape: LlamaShape) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with Llama-3 or linear scaling applied."""
    d = shape.head_dim
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = shape.rope_scaling
    if not scaling:
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * torch.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        scaled = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
        return scaled.float()
    raise ConfigError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos/sin: [B, 1, T, D] (rotate-half convention, as HF Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin [B, 1, T, D] for positions [B, T]."""
    freqs = positions[..., None].float() * inv_freq[None, None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


@dataclass(frozen=True)
class ForwardPart:
    """One part of a forward over several (`LlamaModel.forward_parts`): a [B, T] block
    of tokens with its own slots and mask (`batch`) and RoPE tables (cos, sin
    [B, 1, T, D]). The parts share every matmul and attend apart."""

    shape: tuple[int, int]  # (B, T)
    cos: torch.Tensor
    sin: torch.Tensor
    batch: AttentionBatch


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape, in_features: Optional[int] = None, bias: Optional[bool] = None):
        super().__init__()
        in_features = in_features or shape.hidden_size
        bias = shape.attention_bias if bias is None else bias
        self.n_heads, self.n_kv, self.head_dim = shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim
        self.q_proj = nn.Linear(in_features, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_features, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_features, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, shape.hidden_size, bias=False)
        self.split_sizes = (self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim)
        self.qkv: Optional[nn.Linear] = None  # set by fuse(): one matmul instead of three
        self.kv: Optional[nn.Linear] = None  # set by fuse(): k/v as one matmul, for `queries`

    def fuse(self) -> None:
        """Serving only: q/k/v projections as one matmul (fewer kernel launches and
        Python calls per layer). The separate modules stay for state-dict names, their
        weights views into the fused one; so does `kv`, the k/v rows as a module of their
        own, so that the CPU's routing (models/cpu_linear.py) takes the `queries` path's
        matmul over every token too."""
        self.qkv = _fused_linear(self.q_proj, self.k_proj, self.v_proj)
        n_q = self.split_sizes[0]
        self.kv = _view_linear(self.qkv.weight[n_q:], None if self.qkv.bias is None else self.qkv.bias[n_q:])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                cache: Optional[KVCache] = None, layer: int = 0,
                batch: Optional[AttentionBatch] = None, queries: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: [B, T, in]; mask: [B, 1, T, keys] bool. Without a cache the keys are the
        forward's own T tokens; with one they are the slot's first `batch.key_len`.
        Returns [B, T, H]; with `queries` ([B] int64, a position per row) the keys and
        values of all T tokens are still computed (and cached), but the output only at
        those positions: [B, 1, H]."""
        if queries is None:
            qkv = self.qkv(x) if self.qkv is not None else None
            heads = self._split_heads(qkv, cos, sin)
            if heads is not None:
                return self.o_proj(self._attend_heads(*heads, mask, cache, layer, batch))
            q, k, v = self._project(x, qkv)
            cos_q, sin_q = cos, sin
        else:
            x_q = at_positions(x, queries)  # [B, 1, in]
            if self.kv is not None:
                q, (k, v) = self.q_proj(x_q), self.kv(x).split(self.split_sizes[1:], dim=-1)
            else:
                q, k, v = self.q_proj(x_q), self.k_proj(x), self.v_proj(x)
            cos_q, sin_q = at_positions(cos, queries, dim=2), at_positions(sin, queries, dim=2)
            mask = at_positions(mask, queries, dim=2)
        return self.o_proj(self._attend(q, k, v, (cos_q, sin_q), (cos, sin), mask, cache, layer, batch))

    def forward_parts(self, x: torch.Tensor, parts: Sequence[ForwardPart], cache: KVCache, layer: int
                      ) -> torch.Tensor:
        """x: [R, in], the rows of every part, part after part (part p's [B_p, T_p]
        tokens flattened). The projections are one matmul each over all R rows; each
        part attends over its own slots with its own mask. Returns [R, H]."""
        qkv = self.qkv(x) if self.qkv is not None else None  # [R, (H_q + 2 H_kv) D]
        q, k, v = self._project(x, qkv)  # [R, ...] each
        outs, start = [], 0
        for part in parts:
            B, T = part.shape
            rows = slice(start, start + B * T)
            heads = self._split_heads(None if qkv is None else qkv[rows].view(B, T, -1), part.cos, part.sin)
            if heads is not None:
                out = self._attend_heads(*heads, part.batch.mask, cache, layer, part.batch)
            else:
                q_p, k_p, v_p = (t[rows].view(B, T, -1) for t in (q, k, v))
                rope_p = (part.cos, part.sin)
                out = self._attend(q_p, k_p, v_p, rope_p, rope_p, part.batch.mask, cache, layer, part.batch)
            outs.append(out.reshape(B * T, -1))
            start += B * T
        return self.o_proj(torch.cat(outs) if len(outs) > 1 else outs[0])

    def _project(self, x: torch.Tensor, qkv: Optional[torch.Tensor] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of every token of x ([..., in]); `qkv`: the fused
        projection's output over x, where the caller has it already."""
        if self.qkv is not None:
            return (self.qkv(x) if qkv is None else qkv).split(self.split_sizes, dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope_q: tuple, rope_k: tuple,
                mask: torch.Tensor, cache: Optional[KVCache], layer: int, batch: Optional[AttentionBatch]
                ) -> torch.Tensor:
        """q: [B, Tq, n_heads * D]; k, v: [B, T, n_kv * D], before RoPE (`rope_q`,
        `rope_k`: their (cos, sin)); written into and read from the cache when there is
        one. Returns [B, Tq, n_heads * D], before the output projection."""
        B, Tq, T = q.shape[0], q.shape[1], k.shape[1]
        q = q.reshape(B, Tq, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.reshape(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.reshape(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        return self._attend_heads(rope(q, *rope_q), rope(k, *rope_k), v, mask, cache, layer, batch)

    def _split_heads(self, qkv: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor
                     ) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The fused projection's output qkv [B, T, (H_q + 2 H_kv) D] as q [B, H_q, T, D] and
        k, v [B, H_kv, T, D], RoPE applied to q and k, in one call on the CPU
        (models/cpu_layer_ops.py; `_attend`'s reshapes and `rope` are its twin); None where
        the kernel does not take them, or without a fused projection (qkv None)."""
        if qkv is None:
            return None
        kernel = cpu_layer_ops.kernel_for(qkv, cos, sin)
        if kernel is None or qkv.dim() != 3 or cos.shape != (qkv.shape[0], 1, qkv.shape[1], self.head_dim):
            return None
        q, k, v = kernel.rope_qkv(qkv.contiguous(), cos.contiguous(), sin.contiguous(), self.n_heads, self.n_kv,
                                  self.head_dim)
        return q, k, v

    def _attend_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      cache: Optional[KVCache], layer: int, batch: Optional[AttentionBatch]) -> torch.Tensor:
        """q [B, H_q, Tq, D] and k, v [B, H_kv, T, D], RoPE applied: `_attend` from there on.
        Returns [B, Tq, H_q * D]."""
        B, Tq = q.shape[0], q.shape[2]
        if cache is not None:
            cache.write(layer, batch, k, v)
            k, v = cache.read(layer, batch)
            k, v = k.to(q.dtype), v.to(q.dtype)
            kernel = cpu_attention.attention_kernel() if cpu_attention.takes(q, k, mask) else None
            if kernel is not None:  # a few queries over the cache on the CPU (models/cpu_attention.py)
                return cpu_attention.attend(kernel, q, k, v, mask).reshape(B, Tq, self.n_heads * self.head_dim)
            if mask is batch.mask and not batch.static and q.device.type == "cpu":
                mask = batch.additive_mask(q.dtype)  # made once per forward (AttentionBatch.additive_mask)
        if Tq == 1 and self.n_kv != self.n_heads and q.device.type == "cpu" and GROUP_SINGLE_QUERIES:
            out = single_query_attention(q, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
        return out.transpose(1, 2).reshape(B, Tq, self.n_heads * self.head_dim)


# One query per row (a plain decode step, a drafter's last-position output) on the CPU:
# the query heads that share a KV head go to `scaled_dot_product_attention` as that KV
# head's rows, so each key is read once per KV head instead of once per query head, and
# the CPU kernel gets several query rows instead of one, where it is slowest (2-core
# Xeon, SmolLM2's 9 query and 3 KV heads, 150 keys, float32, per layer: 0.69 against
# 0.41 ms for 32 requests, 0.042 against 0.027 ms for one; ad hoc timing, not kept:
# `bench_overheads.py --measure single-query` times whole decode steps both ways).
# GPUs keep the kernels' own grouped-query attention (`enable_gqa`).
GROUP_SINGLE_QUERIES = True


def single_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention of one query per row: q [B, H, 1, D]; k, v [B, H_kv, S, D]
    with H a multiple of H_kv (query head h reads KV head h // (H / H_kv), as
    `enable_gqa` pairs them); mask [B or 1, 1, 1, S] bool or additive (0 / -inf), or None. Returns [B, H, 1, D].

        H 4, H_kv 2: query heads 0, 1 -> rows 0, 1 of KV head 0; heads 2, 3 -> KV head 1
    """
    B, H, _, D = q.shape
    H_kv = k.shape[1]
    group = H // H_kv
    rows_mask = None
    if mask is not None:
        assert mask.shape[1] == 1 and mask.shape[2] == 1, mask.shape
        rows_mask = mask.expand(mask.shape[0], 1, group, mask.shape[3])  # a view: a head's rows see the same keys
    out = F.scaled_dot_product_attention(q.reshape(B, H_kv, group, D), k, v, attn_mask=rows_mask)  # [B, H_kv, g, D]
    return out.reshape(B, H, 1, D)


def attention_without_per_shape_plans(device: torch.device) -> bool:
    """On a GPU, takes cuDNN out of the kernels `scaled_dot_product_attention` picks
    from (torch's process-wide flag); returns whether it did. cuDNN's attention builds
    a plan for every new shape of queries and keys, and decoding meets a new key length
    at every step: a tree's verify forward and each EAGLE drafting depth are
    multi-token masked queries, which torch 2.11 sent to cuDNN on an H200. There the
    load-time calibration's drafting calls took 45-210 ms, in steps of ~50 ms, while the
    same calls timed again over the shapes the first pass had met took 2-9 ms, and
    adaptive speculation served no tree (docs/benchmarks.md 3.7). The memory-efficient
    and flash kernels take any shape without a plan; one-token plain steps did not pay
    it. CUDA graphs fix their shapes, so they met this only at capture."""
    if device.type != "cuda":
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True


def at_positions(t: torch.Tensor, index: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Row b's entry `index[b]` along `dim`, kept as a size-1 dim: [B, ..., T, ...] ->
    [B, ..., 1, ...]."""
    shape = [t.shape[0]] + [1] * (t.dim() - 1)
    shape[dim] = 1
    idx = index.view(shape).expand(*[1 if d == dim else s for d, s in enumerate(t.shape)])
    return t.gather(dim, idx)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

        self.gate_up: Optional[nn.Linear] = None  # set by fuse()

    def fuse(self) -> None:
        self.gate_up = _fused_linear(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate_up = self.gate_up(x)
            kernel = cpu_layer_ops.kernel_for(gate_up)
            if kernel is not None:  # one call on the CPU (models/cpu_layer_ops.py); the lines below are its twin
                return self.down_proj(kernel.silu_mul(gate_up.contiguous()))
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _fused_linear(*parts: nn.Linear) -> nn.Linear:
    """One Linear whose output is the parts' outputs concatenated. The parts keep their
    names (state dicts) but their weights become views into the fused one: the model
    holds each weight once (a 7B model would otherwise carry ~9 GB of copies)."""
    w = torch.cat([p.weight.detach() for p in parts], dim=0)
    has_bias = parts[0].bias is not None
    b = torch.cat([p.bias.detach() for p in parts]) if has_bias else None
    fused = _view_linear(w, b)
    start = 0
    for p in parts:
        rows = p.weight.shape[0]
        p.weight = nn.Parameter(w[start: start + rows], requires_grad=False)
        if has_bias:
            p.bias = nn.Parameter(b[start: start + rows], requires_grad=False)
        start += rows
    return fused


def _view_linear(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> nn.Linear:
    """A Linear over `weight` ([out, in]) and `bias` as they are, without autograd
    (views stay views; no random initialisation to throw away)."""
    view = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    view.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        view.bias = nn.Parameter(bias, requires_grad=False)
    return view


def fuse_projections(module: nn.Module) -> nn.Module:
    """Fuses every Attention's q/k/v and every MLP's gate/up under `module` (serving)."""
    for m in module.modules():
        if isinstance(m, (Attention, MLP)):
            m.fuse()
    return module


class DecoderLayer(nn.Module):
    """A Llama decoder layer; `input_norm=False` gives EAGLE-1's first head layer."""

    def __init__(self, shape: LlamaShape, input_norm: bool = True):
        super().__init__()
        self.self_attn = Attention(shape)
        self.mlp = MLP(shape.hidden_size, shape.intermediate_size)
        if input_norm:
            self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache=None, layer=0, batch=None, queries=None):
        """x: [B, T, H] -> [B, T, H]; with `queries` ([B]) the output at those positions
        only, [B, 1, H] (every token's KV is still written): see Attention."""
        h = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
        attn = self.self_attn(h, cos, sin, mask, cache, layer, batch, queries)
        x = x if queries is None else at_positions(x, queries)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_parts(self, x: torch.Tensor, parts: Sequence[ForwardPart], cache: KVCache, layer: int
                      ) -> torch.Tensor:
        """x: [R, H], the rows of several parts (`Attention.forward_parts`) -> [R, H]."""
        h = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
        x = x + self.self_attn.forward_parts(h, parts, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


def vocabulary_projection(weight: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, nn.Linear]:
    """A drafting vocabulary's ids [K] (long, on `weight`'s device) and an `nn.Linear`
    without bias (H -> K) holding a detached copy of the vocabulary projection's rows for
    them (output i scores token_ids[i]): what a drafter keeps of an LM head [V, H] to score
    only those tokens. A module, so that on the CPU in float32 the engine routes its calls
    as it does every other linear's (models/cpu_linear.py); through `F.linear` on the bare
    rows, EAGLE-2's drafting depths paid MKL's sgemm, which repacks the rows at every call."""
    ids = token_ids.to(device=weight.device, dtype=torch.long)
    return ids, _view_linear(weight.detach()[ids].contiguous(), None)  # rows [K, H]


def causal_mask(B: int, T: int, device) -> torch.Tensor:
    """[B, T, T] bool lower-triangular: the local mask of a chain of tokens."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()[None].expand(B, T, T)
