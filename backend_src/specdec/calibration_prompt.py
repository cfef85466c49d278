"""The prompt that load-time calibration measures the drafters' acceptance on.

Calibration (`policy.SpeculationPolicy._time_drafters`) runs real generations to learn
how many drafts each method gets accepted: the prior of a new request, and the share of
that a smaller tree keeps. Acceptance depends on the text. Continuing a bare BOS, a chat
model writes a user turn of its own invention, text its drafters were not trained to
predict: on a 2-core Xeon that prior said 0.18 accepted drafts per 2-node EAGLE-3 step
where the chat requests of HumanEval gave 0.40 (docs/benchmarks.md 1.6-1.7).

So when the base model's folder has a tokenizer with a chat template, calibration
continues one fixed request, `CALIBRATION_REQUEST`, in the model's own template: what it
measures is an assistant's answer, as served. The request is none of the benchmark
questions (tools/data/overlap.py's check finds no shared 8-word run). Without a chat
template (or a tokenizer) calibration continues a BOS, as it always did.

The engine deals in token ids and otherwise never tokenizes: this is the one place it
reads the tokenizer, once, at load.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

LOG = logging.getLogger("specdec")
CALIBRATION_REQUEST = ("Explain what a Python dictionary is, then write a short function that counts how often "
                       "each word appears in a sentence.")


def chat_prompt_ids(base_model_dir: str) -> Optional[list[int]]:
    """`CALIBRATION_REQUEST` as a user turn in the chat template of the tokenizer in
    `base_model_dir`, up to the assistant's answer; None when the folder has no
    tokenizer or no chat template (logged when it has one that fails)."""
    folder = Path(base_model_dir)
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        return None
    try:
        from transformers import AutoTokenizer  # heavy; imported only when a tokenizer is there

        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        if not tokenizer.chat_template:
            return None
        ids = tokenizer.apply_chat_template([{"role": "user", "content": CALIBRATION_REQUEST}],
                                            add_generation_prompt=True, tokenize=True)
    except Exception as e:  # transformers raises OSError, ValueError, jinja2 errors, ...
        LOG.warning("calibration continues a BOS: the chat template of %s did not apply (%s: %s)",
                    folder, type(e).__name__, e)
        return None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding (transformers 5's default)
        ids = ids["input_ids"]
    return [int(i) for i in ids]
