"""Multi-row float32 matmuls on CPU through oneDNN, with the weight packed once.

On the CPU, speculative decoding lives or dies by how much more a forward over a few
tokens (a tree of 4-16 nodes, a drafting depth over top-k nodes) costs than over one.
PyTorch's float32 `linear` calls MKL's sgemm, which re-packs the whole weight matrix on
every call; for the few rows a decode step has, that packing is most of the work, and
on AMD EPYC (AVX2) MKL's sgemm for 2-16 rows ran 2-4x slower than its one-row gemv
(docs/DESIGN.md, "The step on a CPU"). oneDNN keeps the weight in its own blocked
layout, packed once: measured there, SmolLM2-135M's target forward over 8 tree tokens
took 82-88 ms instead of 95-101 ms, a batch of 4 single tokens 79-81 ms instead of
96-106 ms, and the LM head over 8 rows 14 ms instead of 23 ms.

One-row calls (plain decoding) stay on MKL's gemv, which was as fast or faster there.
Results equal `F.linear` up to float32 rounding (another summation order), so a tree's
logits can differ from plain decoding's in the last bits, as MKL's own gemm and gemv
already do; the engine's exact-equality tests run in float64, which stays on `F.linear`.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


class PackedCpuLinear(nn.Linear):
    """An `nn.Linear` (same parameters, same state-dict names) whose multi-row calls go
    through oneDNN with a packed copy of the weight, made at the first such call. Only
    modules that take multi-row inputs pay the copy's memory."""

    _packed: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, self.in_features)
        if rows <= 1 or x.dtype != torch.float32 or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        if self._packed is None:
            bias = None if self.bias is None else self.bias.detach().to_mkldnn()
            self._packed = (self.weight.detach().to_mkldnn(), bias)
        weight, bias = self._packed
        flat = x.reshape(rows, self.in_features).contiguous().to_mkldnn()  # [rows, in]
        out = torch._C._nn.mkldnn_linear(flat, weight, bias).to_dense()  # [rows, out]
        return out.reshape(*x.shape[:-1], self.out_features)


def onednn_available() -> bool:
    """oneDNN is in this torch build and not turned off (SPECDEC_CPU_ONEDNN=0)."""
    return torch.backends.mkldnn.is_available() and os.environ.get("SPECDEC_CPU_ONEDNN", "1") != "0"


def use_packed_cpu_linears(module: nn.Module) -> int:
    """Turns every float32 CPU `nn.Linear` under `module` into a `PackedCpuLinear` in
    place (parameters, and weights shared with other modules, stay as they are).
    Returns how many were turned; 0 when oneDNN is not available."""
    if not onednn_available():
        return 0
    count = 0
    for sub in module.modules():
        if type(sub) is nn.Linear and sub.weight.device.type == "cpu" and sub.weight.dtype == torch.float32:
            sub.__class__ = PackedCpuLinear
            sub._packed = None
            count += 1
    return count
