"""The engine's configuration, parsed once from Triton's string parameters.

`EngineConfig.from_params` takes the `parameters` block of the
`speculative_decoding` model's config.pbtxt as `{key: string}` and fails with one
`ConfigError` naming the key for anything unusable (unknown dtype, a placeholder that
`fill_template.py` left behind, a missing checkpoint directory).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

from .errors import ConfigError
from .request import METHODS

DTYPES = ("float32", "float16", "bfloat16", "float64")  # float64: exact-comparison tests
# The checkpoint parameter each speculative method drafts with (tools/ read it too).
DRAFTER_PARAMETERS = {"eagle": "eagle_dir", "eagle2": "eagle_dir", "eagle3": "eagle3_dir", "medusa": "medusa_dir",
                      "draft_model": "draft_model_dir"}


@dataclass(frozen=True)
class EngineConfig:
    base_model_dir: str
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N"
    dtype: str = "float32"
    max_batch_size: int = 8  # KV-cache slots: requests decoded together
    max_seq_len: int = 1024  # prompt + output tokens per request (KV positions per slot)
    max_tokens_limit: int = 1024  # largest max_tokens a request may ask for
    max_queue_size: int = 64  # requests waiting for a slot before new ones are refused
    # Chunked prefill (TensorRT-LLM's `enable_chunked_context`): a prompt longer than
    # `prefill_chunk_tokens` is prefilled one piece of that many tokens a step, so the
    # running requests go on decoding between its pieces (prefill.py); shorter prompts
    # are prefilled whole. Off: every admitted prompt is prefilled whole in the step that
    # admits it, and the running requests wait for all of it. 256: on the 2-core CPU the
    # running requests' longest stall under a 1,536-token prompt was 0.7 s (4.1 s
    # unchunked) and its first token no later (docs/benchmarks.md 2.6).
    enable_chunked_context: bool = True
    prefill_chunk_tokens: int = 256
    # Mixed prefill: in a step with requests to decode, the prompts and pieces being
    # prefilled (up to prefill.PREFILL_TOKENS padded tokens) ride in the verify forward,
    # sharing its matmuls, instead of running a forward of their own before it (as
    # TensorRT-LLM's in-flight batching and vLLM put context and generation tokens in
    # one batch); a request whose prompt rides starts decoding in the next step. Off:
    # every prefill forward runs alone. CUDA graphs (`cuda_graph_mode`) keep prefill
    # apart, since a graph fixes its forward's shapes.
    mixed_prefill: bool = True
    # CPU: the C allocator keeps the memory a step frees for the next step instead of
    # returning it to the system (host_memory.py): a step's big tensors (a tree's
    # full-vocabulary logits, a prompt's activations) then land on pages already mapped,
    # not on fresh ones the kernel faults in. The process holds its peak host memory.
    keep_host_memory: bool = True
    # KV-cache budget (memory.py): slots = min(max_batch_size, the ones that fit).
    kv_cache_free_gpu_mem_fraction: float = 0.9  # of the GPU memory free after loading the weights
    kv_cache_max_tokens: int = 0  # 0: no cap; else at most this many KV positions in all slots
    speculative_method: str = "none"
    eagle_dir: Optional[str] = None
    eagle3_dir: Optional[str] = None
    medusa_dir: Optional[str] = None
    draft_model_dir: Optional[str] = None
    eagle_choices: str = "eagle_default_25"  # static tree for method "eagle"
    medusa_choices: str = "mc_sim_7b_63"
    eagle_depth: int = 5  # EAGLE-2/3 dynamic tree
    eagle_top_k: int = 8
    eagle_total_tokens: int = 0  # tree size incl. root; 0: chosen by timing the base model
    # EAGLE-2/3 rank tree nodes by the draft's cumulative log-probability, as an estimate
    # of acceptance. A draft trained on a high-entropy target is under-confident about the
    # target's *argmax*, which is what greedy verification accepts; dividing the draft
    # logits by this temperature (< 1) before ranking sharpens that estimate. It only
    # changes which nodes form the tree, never what verification accepts (lossless).
    # None: the head checkpoint's `specdec_score_temperature` if it has one, else 1.
    eagle_score_temperature: Optional[float] = None
    num_draft_tokens: int = 4  # draft_model chain length
    # EAGLE and Medusa trees take a branch copied from the request's own text, up to this
    # many tokens, when its last tokens occurred earlier in it (drafters/lookup.py), in
    # place of the tree's last nodes; 0: off. 10 is transformers' prompt_lookup_num_tokens.
    prompt_lookup_tokens: int = 10
    # Shrink/skip speculation when the measured step costs say it does not pay (policy.py).
    # On: fixed trees lose to plain decoding once the batch is large (0.61-0.87x at
    # concurrency 8-32 on the 2-core CPU, docs/benchmarks.md section 2); adaptive tracks
    # plain there and keeps the batch-1 speedup.
    adaptive_speculation: bool = True
    # CUDA graphs for the decode-time forwards of batches up to this size: the target's
    # decode/verify forward, the EAGLE heads' drafting forwards, the draft model's chain
    # (graphs.py; TensorRT-LLM's `cuda_graph_mode`). Off by default: it has only run
    # emulated on CPU (the padded static forwards without capture), never captured on a
    # GPU yet. A capture that fails logs a warning and that forward runs eagerly.
    cuda_graph_mode: bool = False
    cuda_graph_max_batch_size: int = 16
    seed: int = 0  # engine generator for requests that send no seed
    # Where load-time calibration (policy.py) is saved and reused on the same setup
    # (calibration_cache.py): "" -> $SPECDEC_CACHE_DIR, else $XDG_CACHE_HOME/specdec,
    # else ~/.cache/specdec; "off": calibrate at every load, write nothing. The CPU matmul
    # routing measured at load is saved there too (routing_cache.py).
    calibration_cache_dir: str = ""

    @classmethod
    def from_params(cls, params: dict[str, str]) -> "EngineConfig":
        """Builds the config from Triton's string parameters; unknown keys are ignored
        (Triton configs carry keys for other components), empty strings mean "unset"."""
        kwargs = {}
        for f in fields(cls):
            if f.name not in params:
                continue
            raw = str(params[f.name]).strip()
            if "${" in raw:
                raise ConfigError(f"parameter {f.name!r} still holds a template placeholder {raw!r}; "
                                  f"fill it with tools/fill_template.py")
            if raw == "":
                continue
            kwargs[f.name] = _convert(f.name, raw, f.type)
        if "base_model_dir" not in kwargs:
            raise ConfigError("parameter 'base_model_dir' is required")
        config = cls(**kwargs)
        config.validate()
        return config

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"parameter 'dtype' must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"parameter 'device' must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.speculative_method not in METHODS:
            raise ConfigError(f"parameter 'speculative_method' must be one of {', '.join(METHODS)}, "
                              f"got {self.speculative_method!r}")
        for name in ("max_batch_size", "max_seq_len", "max_tokens_limit", "eagle_depth", "eagle_top_k",
                     "cuda_graph_max_batch_size", "prefill_chunk_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parameter {name!r} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.kv_cache_free_gpu_mem_fraction <= 1.0:
            raise ConfigError(f"parameter 'kv_cache_free_gpu_mem_fraction' must be in (0, 1], "
                              f"got {self.kv_cache_free_gpu_mem_fraction}")
        if self.prompt_lookup_tokens < 0:
            raise ConfigError(f"parameter 'prompt_lookup_tokens' must be >= 0, got {self.prompt_lookup_tokens}")
        if self.kv_cache_max_tokens < 0:
            raise ConfigError(f"parameter 'kv_cache_max_tokens' must be >= 0, got {self.kv_cache_max_tokens}")
        if not (Path(self.base_model_dir) / "config.json").is_file():
            raise ConfigError(f"parameter 'base_model_dir': no config.json in {self.base_model_dir!r}")
        for name in ("eagle_dir", "eagle3_dir", "medusa_dir", "draft_model_dir"):
            value = getattr(self, name)
            if value is not None and not (Path(value) / "config.json").is_file():
                raise ConfigError(f"parameter {name!r}: no config.json in {value!r}")
        needed = DRAFTER_PARAMETERS.get(self.speculative_method)
        if needed and getattr(self, needed) is None:
            raise ConfigError(f"speculative_method {self.speculative_method!r} needs parameter {needed!r}")


def _convert(name: str, raw: str, typ) -> object:
    typ = str(typ)
    try:
        if "bool" in typ:
            lowered = raw.lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return lowered in ("true", "1", "yes")
        if "int" in typ:
            return int(raw)
        if "float" in typ:
            return float(raw)
    except ValueError:
        raise ConfigError(f"parameter {name!r} must be a {typ.replace('Optional[', '').rstrip(']')}, "
                          f"got {raw!r}") from None
    return raw
