"""Turning target logits into what verification needs, per request and per tree node.

`process_logits` applies, in order: the logit bias (a fixed amount per token id), bad
words, min_tokens (end_id suppressed while a node's output index is below it),
penalties (repetition over prompt + output, presence and frequency over output, as
vLLM), then `probabilities` applies temperature, top-k, top-p and min-p. Greedy rows
take the argmax of the processed logits.

Losslessness: the logit bias is the same at every node; bad single-token words and
min_tokens depend only on a node's depth, so they are exact for tree nodes. Penalties
and multi-token bad words depend on the path history; the engine does not speculate
for a request while they can act (`needs_plain_steps`), so they are exact too.

Random numbers come from a per-request `torch.Generator` on the CPU, seeded with the
request's seed: a seeded request repeats exactly, and requests never share state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .models import cpu_layer_ops
from .request import GenerationRequest
from .transfer import to_device

NEG_INF = float("-inf")


@dataclass
class LogitsRow:
    """What logits processing needs from one request for one step."""

    request: GenerationRequest
    history: list[int]  # prompt + output tokens so far (the root included)
    num_generated: int  # output tokens so far; the token drawn after a depth-d node is output number num_generated + d


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dim: [..., V] -> [...] int64, the first maximal index
    on ties, as `argmax`. Through `max(dim)`, which returns the same index: on the
    2-core Xeon, float32, torch 2.13, `argmax` over SmolLM2's 49,152 logits took 79 /
    305 µs for 1 / 8 rows and `max` 25 / 96 (ad hoc, hot caches; an 8-node verify's
    argmax took 0.56 ms a step in the engine). Float32 on the CPU goes through one C++
    call (models/cpu_layer_ops.py), the same indices: `max` took 105 µs over 9 rows and
    419 over 32 (ad hoc, hot caches), as much as the reading the rows needs several times over."""
    kernel = cpu_layer_ops.kernel_for(logits)
    if kernel is not None and logits.dim() >= 1 and logits.shape[-1] > 0:
        return kernel.greedy_tokens(logits.contiguous())
    return logits.max(dim=-1).indices


def needs_plain_steps(req: GenerationRequest) -> bool:
    """True when processing depends on path history, so tree nodes cannot share it."""
    return req.sampling.has_penalties or any(len(w) > 1 for w in req.bad_words)


def _processed(req: GenerationRequest) -> bool:
    """Whether `process_logits` changes anything of this request's rows (every
    processing step of its loop has its condition here)."""
    return bool(req.bad_words or req.logit_bias or (req.end_id is not None and req.sampling.min_tokens > 0)
                or req.sampling.has_penalties)


def process_logits(logits: torch.Tensor, rows: list[LogitsRow], depth: torch.Tensor) -> torch.Tensor:
    """logits: [B, N, V] float32 (row b, node n = distribution after node n);
    depth: [B, N] int64 node depths. Returns the processed logits: a new tensor, or
    `logits` itself where no row asks for any processing (no copy of a tree's
    full-vocabulary logits per step)."""
    B, N, V = logits.shape
    assert len(rows) == B and depth.shape == (B, N), (len(rows), depth.shape)
    if not any(_processed(row.request) for row in rows):
        return logits
    out = logits.clone()
    for b, row in enumerate(rows):  # (a step added here adds its condition to `_processed`)
        req = row.request
        banned = [w[0] for w in req.bad_words if len(w) == 1]
        for w in req.bad_words:
            if len(w) > 1 and len(row.history) >= len(w) - 1 and row.history[len(row.history) - len(w) + 1:] == w[:-1]:
                banned.append(w[-1])
        if req.logit_bias:
            ids = to_device(list(req.logit_bias), out.device, torch.long)
            out[b, :, ids] += to_device(list(req.logit_bias.values()), out.device, out.dtype)
        if banned:
            out[b].index_fill_(-1, to_device(banned, out.device), NEG_INF)
        if req.end_id is not None and req.sampling.min_tokens > 0:
            early = (row.num_generated + depth[b]) < req.sampling.min_tokens  # [N] (no bool indexing: a sync)
            out[b, :, req.end_id] = out[b, :, req.end_id].masked_fill(early, NEG_INF)
        s = req.sampling
        if s.has_penalties:
            _apply_penalties(out[b], row.history, row.num_generated, s.repetition_penalty,
                             s.presence_penalty, s.frequency_penalty)
    return out


def _apply_penalties(logits: torch.Tensor, history: list[int], num_generated: int,
                     repetition: float, presence: float, frequency: float) -> None:
    """logits: [N, V], in place. Repetition over prompt + output; presence and
    frequency over output tokens only."""
    V = logits.shape[-1]
    if repetition != 1.0 and history:
        seen = to_device(sorted(set(history)), logits.device, torch.long)
        vals = logits[:, seen]
        logits[:, seen] = torch.where(vals > 0, vals / repetition, vals * repetition)
    if (presence or frequency) and num_generated > 0:
        out_tokens = to_device(history[len(history) - num_generated:], logits.device, torch.long)
        counts = torch.bincount(out_tokens, minlength=V).to(logits.dtype)
        logits -= presence * (counts > 0).to(logits.dtype) + frequency * counts


@dataclass
class SamplingTensors:
    """The sampling settings of a batch's rows, on the device."""

    temperature: torch.Tensor  # [B] float32 > 0 (1 for greedy rows)
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32 in (0, 1]
    truncate: bool  # some row has top-k, top-p or min-p on (known on the host: no sync to branch)
    top_k_bound: int = 0  # every row has top-k on, at most this (0: some row has not)
    min_p: Optional[torch.Tensor] = None  # [B] float32 in [0, 1], 0 = off; None: off in every row (no tensor)

    def rows(self, start: int, stop: int) -> "SamplingTensors":
        return SamplingTensors(self.temperature[start:stop], self.top_k[start:stop], self.top_p[start:stop],
                               self.truncate, self.top_k_bound,
                               None if self.min_p is None else self.min_p[start:stop])

    def log_min_p(self) -> torch.Tensor:
        """[B] log of min-p (-inf where off): a token is kept while its logit is at most
        this far below the most likely one's."""
        if self.min_p is None:
            return torch.full_like(self.temperature, NEG_INF)
        return self.min_p.log()


# Top-p's candidates on the CPU: the most likely tokens ranked first, the whole vocabulary
# sorted only for the rows whose nucleus does not fit in them. Sorting the 49,152-token
# vocabulary at every node of every sampled tree was the largest single cost of the
# sampled steps in the statistical tests (tests/test_engine_sampling.py, test_smollm2.py,
# under cProfile); ranking the candidates cut those tests' time by about a third.
TOP_P_CANDIDATES = 256


def probabilities(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """Sampling distribution. logits: [B, N, V]. Returns probs [B, N, V] float32.

    Min-p keeps the tokens at least min_p times as likely as the most likely one. That
    ratio does not change when top-k and top-p renormalise, so applying min-p after them
    (as `transformers` and SGLang do) keeps the tokens that all three keep.

    Top-k, top-p and min-p keep a prefix of the tokens ranked by probability, so only the
    ranks that can be kept are ranked: the largest top-k where every row has one (any
    device); else, on the CPU, TOP_P_CANDIDATES (or the largest top-k, if more), and
    the rows whose nucleus reaches past them again over the whole vocabulary (finding
    them reads the device, which costs a CPU nothing); on a GPU the whole vocabulary,
    which needs no read."""
    V = logits.shape[-1]
    scaled = logits.float() / params.temperature[:, None, None]
    if not params.truncate:
        return torch.softmax(scaled, dim=-1)
    k = torch.where(params.top_k > 0, params.top_k, torch.full_like(params.top_k, V))  # [B]
    cut = Cut(k, params.top_p, params.log_min_p())
    if params.top_k_bound:
        return _truncated(scaled, cut, min(V, params.top_k_bound))[0]
    if not reads_are_free(scaled.device):
        return _truncated(scaled, cut, V)[0]
    probs, spilled = _truncated(scaled, cut, min(V, max(TOP_P_CANDIDATES, int(params.top_k.max()))))
    # Rows that cut nothing (sampled beside rows that do) take the plain softmax: they would
    # spill, and ranking a whole vocabulary per node is what the candidates save.
    whole = (cut.k >= V) & (cut.top_p >= 1.0) & torch.isneginf(cut.log_min_p)  # [B]
    rows = (spilled & ~whole[:, None]).nonzero()  # [R, 2]: (b, n) of the rows to rank again in full
    if len(rows):
        b, n = rows[:, 0], rows[:, 1]
        probs[b, n] = _truncated(scaled[b, n][:, None], cut.rows(b), V)[0][:, 0]
    plain = whole.nonzero().flatten()
    if len(plain):
        probs[plain] = torch.softmax(scaled[plain], dim=-1)
    return probs


def reads_are_free(device: torch.device) -> bool:
    """Whether the host can read a value on `device` without waiting for queued work."""
    return device.type == "cpu"


@dataclass
class Cut:
    """Where each row's ranking is cut: the three settings as [B] tensors."""

    k: torch.Tensor  # [B] int64, V where top-k is off
    top_p: torch.Tensor  # [B] float32 in (0, 1]
    log_min_p: torch.Tensor  # [B] float32, -inf where min-p is off

    def rows(self, index: torch.Tensor) -> "Cut":
        return Cut(self.k[index], self.top_p[index], self.log_min_p[index])


def _truncated(scaled: torch.Tensor, cut: Cut, ranked: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scaled [B, N, V] logits: the softmax over the tokens top-k, top-p and min-p keep,
    ranking only the `ranked` most likely ones, and [B, N] True where the kept tokens may
    reach past them (those rows' probs are not exact). Ties at the cut keep whichever the
    ranking put first."""
    V = scaled.shape[-1]
    if ranked >= V:
        values, order = scaled.sort(dim=-1, descending=True)
    else:
        values, order = scaled.topk(ranked, dim=-1)  # [B, N, ranked], most likely first
    k, top_p, log_min_p = cut.k[:, None, None], cut.top_p[:, None, None], cut.log_min_p[:, None, None]
    drop = torch.arange(ranked, device=scaled.device)[None, None, :] >= k
    # Min-p: a probability ratio to the most likely token, a logit difference here.
    below_min_p = (values - values[..., :1]) < log_min_p  # [B, N, ranked]
    kept = values.masked_fill(drop, NEG_INF)
    # Top-p measures mass under the top-k distribution, whose normaliser is the ranked
    # tokens' own where a row's top-k fits in them, else the whole row's.
    log_norm = kept.logsumexp(-1, keepdim=True)
    if ranked < V:
        log_norm = torch.where(k <= ranked, log_norm, scaled.logsumexp(-1, keepdim=True))
    mass = torch.exp(kept - log_norm)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    before = mass.cumsum(-1) - mass
    drop = drop | (before >= top_p) | below_min_p  # not |=: drop is [B, 1, ranked] until here
    # Ranked tokens are kept to the last; min-p would keep the next unranked one too.
    spilled = ((k > ranked) & (mass.sum(-1, keepdim=True) < top_p) & ~below_min_p[..., -1:])[..., 0]
    probs = torch.zeros_like(scaled).scatter(-1, order, torch.softmax(values.masked_fill(drop, NEG_INF), dim=-1))
    return probs, spilled


def sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs: [B, V]; uniforms: [B] in [0, 1). The token whose CDF interval holds u."""
    cdf = probs.cumsum(-1)
    u = uniforms[:, None] * cdf[:, -1:]
    idx = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    return idx.clamp(max=probs.shape[-1] - 1)


class RequestRng:
    """One request's random stream (CPU generator: reproducible on any device)."""

    def __init__(self, seed: int):
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(seed)

    def uniforms(self, n: int) -> torch.Tensor:
        return torch.rand(n, generator=self.generator, dtype=torch.float64).float()


def sampling_tensors(rows: list[LogitsRow], device) -> Optional[SamplingTensors]:
    """The rows' temperature, top-k, top-p and min-p on `device` (one transfer);
    temperature 0 rows get 1."""
    if not rows:
        return None
    device = torch.device(device)
    settings = [r.request.sampling for r in rows]
    floats = to_device([[s.temperature or 1.0 for s in settings], [s.top_p for s in settings],
                        [s.min_p for s in settings]], device, torch.float32)  # [3, B]
    top_k = to_device([s.top_k for s in settings], device, torch.long)
    truncate = any(s.top_k > 0 or s.top_p < 1.0 or s.min_p > 0.0 for s in settings)
    bound = max(s.top_k for s in settings) if all(s.top_k > 0 for s in settings) else 0
    return SamplingTensors(floats[0], top_k, floats[1], truncate, bound, floats[2])
