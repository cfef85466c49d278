#!/usr/bin/env python3
"""Fills `${placeholders}` in a model's `config.pbtxt` template; fails loudly.

Command line (TensorRT-LLM's, unchanged):

    python3 tools/fill_template.py -i <config.pbtxt> key:value,key:value

`-i/--in_place` rewrites the file; without it the result goes to stdout. In the
substitution string `\\,` is a literal comma, `\\:` a literal colon and `\\\\` a
backslash; a value may also hold unescaped colons after the first one
(`tokenizer_dir:/a:b` sets `/a:b`).

Placeholder syntax in our templates:
- `${name}`          required: filling fails while it is left;
- `${name:default}`  optional: takes `default` (may be empty, `${name:}`) when no
                     value is given. Defaults hold no `}`.

Unlike TensorRT-LLM's script, this one fails instead of leaving a half-filled file:
- a key is an error (naming it) unless it is a placeholder of this file, of one of our
  shipped templates (`model_repository/*/config.pbtxt`), or one of
  `TRTLLM_TEMPLATE_KEYS` below, the keys TensorRT-LLM's `inflight_batcher_llm`
  templates take, so the tutorials' command lines run unchanged; such keys are
  ignored with a note on stderr when this file does not use them;
- when a required placeholder is left after filling, the file is not written and the
  exit status is 1, naming what is missing (`--partial` writes it anyway, keeping
  the optional placeholders for a later pass).

Importable: `parse_substitutions`, `placeholders`, `fill_text`, `fill_file`.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Optional

PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::([^}]*))?\}")
TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "model_repository"

# Keys of TensorRT-LLM's inflight_batcher_llm templates (preprocessing, postprocessing,
# tensorrt_llm, tensorrt_llm_bls, ensemble) that tutorials pass. Accepted everywhere;
# ignored where our template has no such placeholder.
TRTLLM_TEMPLATE_KEYS = frozenset("""
    accumulate_tokens add_special_tokens batch_scheduler_policy batching_strategy
    bls_instance_count cancellation_check_period_ms cross_kv_cache_fraction
    cuda_graph_cache_size cuda_graph_mode decoding_mode decoupled_mode eagle_choices
    enable_chunked_context enable_context_fmha_fp32_acc enable_kv_cache_reuse
    enable_trt_overlap encoder_engine_dir encoder_input_features_data_type engine_dir
    exclude_input_in_output executor_worker_path gpt_model_path gpu_device_ids
    gpu_weights_percent guided_decoding_backend iter_stats_max_iterations
    kv_cache_free_gpu_mem_fraction kv_cache_host_memory_bytes kv_cache_onboard_blocks
    logits_datatype lookahead_ngram_size lookahead_verification_set_size
    lookahead_window_size lora_cache_gpu_memory_fraction lora_cache_host_memory_bytes
    lora_cache_max_adapter_size lora_cache_optimal_adapter_size lora_prefetch_dir
    max_attention_window_size max_beam_width max_num_images max_num_sequences
    max_queue_delay_microseconds max_queue_size max_tokens_in_paged_kv_cache
    medusa_choices multi_block_mode multimodal_encoders_name multimodal_model_path
    normalize_log_probs participant_ids postprocessing_instance_count
    preprocessing_instance_count prompt_embedding_table_data_type recv_poll_period_ms
    request_stats_max_iterations sink_token_length skip_special_tokens
    speculative_decoding_fast_logits stats_check_period_ms tensorrt_llm_draft_model_name
    tensorrt_llm_model_name tokenizer_dir tokenizer_type triton_backend
    triton_max_batch_size visual_model_path xgrammar_tokenizer_info_path
""".split())


class TemplateError(ValueError):
    """A substitution string or template cannot be filled; the message says which key."""


def _split_unescaped(text: str, sep: str, maxsplit: int = -1) -> list[str]:
    """Splits on `sep` not preceded by a backslash; keeps escapes for a later `_unescape`."""
    parts, current, i = [], "", 0
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text):
            current += text[i:i + 2]
            i += 2
            continue
        if ch == sep and (maxsplit < 0 or len(parts) < maxsplit):
            parts.append(current)
            current = ""
        else:
            current += ch
        i += 1
    parts.append(current)
    return parts


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text)


def parse_substitutions(text: str) -> dict[str, str]:
    """`"a:1,b:x\\,y"` → `{"a": "1", "b": "x,y"}`. Empty text → `{}`."""
    result: dict[str, str] = {}
    for item in _split_unescaped(text.strip(), ","):
        if not item.strip():
            continue
        key_value = _split_unescaped(item, ":", maxsplit=1)
        if len(key_value) != 2:
            raise TemplateError(f"substitution {_unescape(item)!r} is not key:value")
        key, value = _unescape(key_value[0]).strip(), _unescape(key_value[1])
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise TemplateError(f"substitution key {key!r} is not a valid placeholder name")
        if key in result and result[key] != value:
            raise TemplateError(f"key {key!r} is given twice with different values")
        result[key] = value
    return result


def placeholders(template: str) -> dict[str, Optional[str]]:
    """Placeholder name → its default (None for a required one)."""
    found: dict[str, Optional[str]] = {}
    for m in PLACEHOLDER.finditer(template):
        name, default = m.group(1), m.group(2)
        if found.get(name) is None:
            found[name] = default
    return found


def shipped_template_keys(templates_dir: Path = TEMPLATES_DIR) -> set[str]:
    keys: set[str] = set()
    for path in sorted(templates_dir.glob("*/config.pbtxt")):
        keys.update(placeholders(path.read_text()))
    return keys


def fill_text(template: str, values: dict[str, str], *, apply_defaults: bool = True,
              known_keys: Optional[set[str]] = None) -> tuple[str, list[str], list[str]]:
    """Fills `template`; returns (text, ignored keys, required placeholders left).

    Raises `TemplateError` for a key that is neither in `template` nor in `known_keys`
    (default: our shipped templates' keys + `TRTLLM_TEMPLATE_KEYS`).
    """
    own = placeholders(template)
    if known_keys is None:
        known_keys = shipped_template_keys() | TRTLLM_TEMPLATE_KEYS
    unknown = sorted(k for k in values if k not in own and k not in known_keys)
    if unknown:
        raise TemplateError(
            f"unknown key(s) {', '.join(map(repr, unknown))}: not a placeholder of this template "
            f"(it has: {', '.join(sorted(own)) or 'none'}) nor of any known template")
    ignored = sorted(k for k in values if k not in own)
    missing: list[str] = []

    def substitute(m: re.Match) -> str:
        name, default = m.group(1), m.group(2)
        if name in values:
            return values[name]
        if default is not None:
            return default if apply_defaults else m.group(0)
        if name not in missing:
            missing.append(name)
        return m.group(0)

    return PLACEHOLDER.sub(substitute, template), ignored, missing


def fill_file(path: Path, values: dict[str, str], *, out: Optional[Path] = None,
              partial: bool = False) -> str:
    """Fills the template at `path` and writes it to `out` (may equal `path`).

    Raises `TemplateError` on unknown keys or, unless `partial`, on required
    placeholders left (then nothing is written). Returns the filled text.
    """
    path = Path(path)
    text, ignored, missing = fill_text(path.read_text(), values)
    if missing:
        if not partial:
            raise TemplateError(f"{path}: no value for required placeholder(s) "
                                f"{', '.join(missing)}; pass them as key:value")
        text, _, _ = fill_text(path.read_text(), values, apply_defaults=False)
    for key in ignored:
        print(f"fill_template: {path}: ignoring key {key!r} (not used by this template)",
              file=sys.stderr)
    if out is not None:
        Path(out).write_text(text)
    return text


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file_path", help="path of the config.pbtxt template")
    parser.add_argument("substitutions", nargs="?", default="",
                        help="key_1:value_1,key_2:value_2 (\\, escapes a comma)")
    parser.add_argument("--in_place", "-i", action="store_true", help="rewrite the file in place")
    parser.add_argument("--partial", action="store_true",
                        help="write even when required placeholders are left")
    args = parser.parse_args(argv)
    try:
        values = parse_substitutions(args.substitutions)
        text = fill_file(Path(args.file_path), values,
                         out=Path(args.file_path) if args.in_place else None, partial=args.partial)
    except (TemplateError, OSError) as e:
        print(f"fill_template: error: {e}", file=sys.stderr)
        return 1
    if not args.in_place:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
