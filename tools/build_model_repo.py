#!/usr/bin/env python3
"""Writes a complete, filled Triton model repository for given checkpoints.

    python3 tools/build_model_repo.py --out /tmp/repo                      # shipped family
    python3 tools/build_model_repo.py --out /tmp/repo --method eagle3 --decoupled false \\
        --set max_tokens_limit:256,device:cuda

Copies the templates of `MODELS` (`model_repository/*`: the entries `ensemble` and
`tensorrt_llm_bls` and the three models they call) into `--out` and fills each one
through `fill_template.fill_file`, so a bad key or a missing required value fails
here, not at server start. Defaults are the default family that
`tools/setup_model.py` assembles in `.cache/smollm2/` (`family.py`): SmolLM2-135M-Instruct
and its drafters. Drafter directories that do not exist are left unset, and a
`--method` that needs a missing one is an error. `--method auto` picks
eagle2 when the family has an EAGLE head, else plain decoding.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from family import BASE_DIR, DRAFTER_DIRS  # noqa: E402
from fill_template import TemplateError, fill_file, parse_substitutions, placeholders  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "backend_src"))
from specdec.config import DRAFTER_PARAMETERS  # noqa: E402  (no torch: config and its errors only)

REPO_ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = REPO_ROOT / "model_repository"
# Two entries: `ensemble` (TensorRT-LLM's) and `tensorrt_llm_bls` (the same requests; a
# client's cancellation reaches the engine), over the three models they call.
MODELS = ("preprocessing", "speculative_decoding", "postprocessing", "ensemble", "tensorrt_llm_bls")
DRAFTERS = DRAFTER_DIRS  # option / engine parameter → default checkpoint


def _has_checkpoint(path: Optional[Path]) -> bool:
    return path is not None and (path / "config.json").is_file()


def repo_values(base: Path, method: str = "auto", tokenizer_dir: Optional[Path] = None,
                drafters: Optional[dict[str, Optional[Path]]] = None, decoupled: bool = True,
                extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The substitutions for all the templates. Raises `TemplateError` for an unusable choice."""
    for name, path in (("--base", base), ("--tokenizer-dir", tokenizer_dir or base)):
        if not Path(path).is_dir():
            raise TemplateError(f"{name} {path} is not a directory")
    drafters = {**DRAFTERS, **(drafters or {})}
    present = {k: p.resolve() for k, p in drafters.items() if _has_checkpoint(p)}
    if method == "auto":
        method = "eagle2" if "eagle_dir" in present else "none"
    needed = DRAFTER_PARAMETERS.get(method)  # the checkpoint parameter the method drafts with
    if needed and needed not in present:
        raise TemplateError(f"--method {method} needs a checkpoint in --{needed.replace('_', '-')}"
                            f" (no config.json in {drafters.get(needed)})")
    values = {
        "base_model_dir": str(base.resolve()),
        "tokenizer_dir": str((tokenizer_dir or base).resolve()),
        "speculative_method": method,
        "decoupled_mode": "true" if decoupled else "false",
        **{k: str(p) for k, p in present.items()},
    }
    values.update(extra or {})
    if values.get("device", "").startswith("cuda") and "instance_kind" not in values:
        values["instance_kind"] = "KIND_GPU"  # Triton then passes each instance its GPU id
    return values


def build(out: Path, values: dict[str, str], models=MODELS, templates: Path = TEMPLATES) -> Path:
    """Copies and fills `models` into `out` (replacing what is there). Returns `out`."""
    out = Path(out)
    every_key = set()
    for model in models:
        every_key |= set(placeholders((templates / model / "config.pbtxt").read_text()))
    unknown = sorted(set(values) - every_key)
    if unknown:
        raise TemplateError(f"unknown key(s) {', '.join(unknown)}: no template uses them")
    out.mkdir(parents=True, exist_ok=True)
    for model in models:
        target = out / model
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(templates / model, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        config = target / "config.pbtxt"
        own = placeholders(config.read_text())
        fill_file(config, {k: v for k, v in values.items() if k in own}, out=config)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder to write the repository into")
    p.add_argument("--base", type=Path, default=BASE_DIR, help="base model checkpoint")
    p.add_argument("--tokenizer-dir", type=Path, default=None, help="default: --base")
    p.add_argument("--method", default="auto",
                   help="none|medusa|eagle|eagle2|eagle3|draft_model|auto (default auto)")
    for key, default in DRAFTERS.items():
        flag = "--draft-dir" if key == "draft_model_dir" else "--" + key.replace("_", "-")
        p.add_argument(flag, dest=key, type=Path, default=default, help=f"default {default}")
    p.add_argument("--decoupled", default="true", choices=("true", "false"),
                   help="decoupled (streaming) speculative_decoding model (default true)")
    p.add_argument("--device", help="engine device: cpu | cuda[:N]")
    p.add_argument("--dtype", help="float32 | float16 | bfloat16")
    p.add_argument("--triton-max-batch-size", help="max_batch_size of the Triton models")
    p.add_argument("--max-batch-size", help="engine: requests decoded together")
    p.add_argument("--max-seq-len", help="engine: prompt + output tokens per request")
    p.add_argument("--max-tokens-limit", help="engine: largest max_tokens a request may ask")
    p.add_argument("--set", default="", help="more key:value,... substitutions (fill_template syntax)")
    args = p.parse_args(argv)
    extra = {k: getattr(args, a) for k, a in (
        ("device", "device"), ("dtype", "dtype"), ("triton_max_batch_size", "triton_max_batch_size"),
        ("max_batch_size", "max_batch_size"), ("max_seq_len", "max_seq_len"),
        ("max_tokens_limit", "max_tokens_limit")) if getattr(args, a) is not None}
    try:
        extra.update(parse_substitutions(args.set))
        values = repo_values(args.base, args.method, args.tokenizer_dir,
                             {k: getattr(args, k) for k in DRAFTERS}, args.decoupled == "true", extra)
        build(args.out, values)
    except (TemplateError, OSError) as e:
        print(f"build_model_repo: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} (speculative_method={values['speculative_method']}, "
          f"decoupled_mode={values['decoupled_mode']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
