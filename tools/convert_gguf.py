"""Converts a Llama-family GGUF file into a standard Hugging Face checkpoint directory.

    python tools/convert_gguf.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out .cache/models/smollm2

Writes `config.json`, `generation_config.json`, `model.safetensors` (float32, or
`--dtype`), `tokenizer.json`, `tokenizer_config.json` (bos/eos/pad and the chat template)
and `special_tokens_map.json`. Architectures: `llama` (Llama, Mistral, SmolLM) and `qwen2`.
Tensor types: whatever the `gguf` package dequantizes (F32, F16, BF16, Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1 and the K-quants).

Weights are read with `gguf`'s own reader and dequantizer. The one transformation is
llama.cpp's: its converter stores a `llama` model's q/k projections with the two
halves of every RoPE pair interleaved (it permutes the rows so that GGML's rotate-
adjacent-pairs RoPE computes what Hugging Face's rotate-half RoPE does), and this undoes
that permutation. Qwen2 files are stored unpermuted. The tokenizer is rebuilt by
`transformers`' GGUF tokenizer converter.

Sampling: `generation_config.json` carries the sampling the file's author recommends
(llama.cpp's `general.sampling.temp`, `top_p`, `top_k`, `min_p`, `penalty_repeat`, as
`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` with `do_sample`), and
`--sampling KEY=VALUE` sets or overrides one; servers take these as the defaults of a
request that sets none (vLLM's `--generation-config auto`, this repository's front door).

Special tokens are the file's own (`tokenizer.ggml.bos/eos/padding_token_id`), not the
ones transformers' GGUF tokenizer reports: for a `llama` file it reports bos as eos too
(SmolLM2-Instruct's `<|im_start|>`). End of turn: when the chat template ends its turns
with a token other than the file's eos (a ChatML template with eos `<|endoftext|>`), that
token (`<|im_end|>` for ChatML) becomes eos, as the original checkpoints' `config.json`
say. A file with no padding id pads with eos.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# GGUF tensor name (after `blk.N.`) -> Hugging Face name (after `model.layers.N.`)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors a GGUF may carry that a Hugging Face checkpoint recomputes (llama3 RoPE factors).
_DERIVED = ("rope_freqs.weight",)
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
# llama.cpp's recommended-sampling metadata -> generation_config.json key
SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


class GGUFError(ValueError):
    """The file is not a GGUF this converter supports; the message says why."""


@dataclass(frozen=True)
class GGUFModel:
    architecture: str
    config: dict           # Hugging Face config.json keys
    state: dict            # HF name -> float32 tensor
    special_ids: dict      # {"bos", "eos", "pad"} -> the file's token id, or None
    sampling: dict         # generation_config.json sampling keys the file recommends


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


def _as_written(value) -> float:
    """A float32 field as its author wrote it: 1e-05, not 9.999999747378752e-06."""
    return float(f"{float(value):.7g}")


def read_config(reader) -> tuple[str, dict]:
    """The Hugging Face config of the GGUF's model (transformers 5 spelling of RoPE)."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def get(name, default=None):
        return _field(reader, f"{arch}.{name}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    vocab = int(get("vocab_size", 0) or len(tokens))
    if not vocab:
        raise GGUFError("the GGUF names no vocabulary size and carries no tokenizer")
    names = {t.name for t in reader.tensors}
    rope = {"rope_theta": _as_written(get("rope.freq_base", 10000.0)), "rope_type": "default"}
    scaling = get("rope.scaling.type")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=float(get("rope.scaling.factor")))
    elif scaling not in (None, "none"):
        raise GGUFError(f"RoPE scaling {scaling!r} is not supported (none, linear)")
    config = {
        "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "hidden_act": "silu",
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": _as_written(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": rope,
        "attention_bias": arch == "qwen2",
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": "float32",
    }
    return arch, config


def read_special_ids(reader) -> dict:
    """The token ids the file names bos, eos and pad (None where it names none)."""
    keys = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id"}
    ids = {}
    for name, key in keys.items():
        value = _field(reader, f"tokenizer.ggml.{key}")
        ids[name] = None if value is None else int(value)
    return ids


def read_sampling(reader) -> dict:
    """The file's recommended sampling (`general.sampling.*`) in generation_config.json's keys."""
    sampling = {}
    for key, name in SAMPLING_KEYS.items():
        value = _field(reader, key)
        if value is not None:
            sampling[name] = int(value) if name == "top_k" else _as_written(value)
    return sampling


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation.

    llama.cpp stores, per head of `d` rows, the rows in the order
    [0, d/2, 1, d/2+1, ...] (pairs interleaved); Hugging Face keeps them as
    [0, 1, ..., d/2-1 | d/2, ..., d-1] (halves). Example, d = 4: stored rows
    [r0, r2, r1, r3] come back as [r0, r1, r2, r3].
    """
    rows = w.shape[0]
    d = rows // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    if gguf_name in _DERIVED:
        return None
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}"
    raise GGUFError(f"tensor {gguf_name!r} has no Hugging Face Llama/Qwen2 counterpart")


def read_gguf(path: str | Path) -> GGUFModel:
    """The model in the GGUF at `path`: its config and float32 weights, Hugging Face names."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"no GGUF file at {str(path)!r}")
    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise GGUFError(f"{path.name}: not a readable GGUF file ({e})") from None
    arch, config = read_config(reader)
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise GGUFError(f"tensor {tensor.name!r}: type {tensor.tensor_type.name} cannot be dequantized "
                            f"by the installed gguf package") from None
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest dimension first
        values = np.asarray(values, dtype=np.float32).reshape(shape)
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            values = unpermute_rope_rows(values, config["num_attention_heads"])
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            values = unpermute_rope_rows(values, config["num_key_value_heads"])
        state[name] = torch.from_numpy(np.array(values, copy=True))
    missing = [n for n in ("model.embed_tokens.weight", "model.norm.weight") if n not in state]
    if missing:
        raise GGUFError(f"{path.name} lacks {', '.join(missing)}")
    return GGUFModel(arch, config, state, read_special_ids(reader), read_sampling(reader))


def _turn_end_token(chat_template: str | None, vocab: dict) -> str | None:
    """The token of `vocab` that ends an assistant turn in `chat_template`, if it names one
    (ChatML: `<|im_end|>`)."""
    if not chat_template:
        return None
    for candidate in ("<|im_end|>", "<|eot_id|>", "<|end|>", "</s>"):
        if candidate in chat_template and candidate in vocab:
            return candidate
    return None


def write_tokenizer(path: Path, out: Path, special_ids: dict) -> dict:
    """Rebuilds the GGUF's tokenizer with transformers, sets its special tokens, saves it.

    `special_ids`: the file's {"bos", "eos", "pad"} ids (`read_special_ids`). Returns the
    ids {bos_token_id, eos_token_id, pad_token_id} for the model's config.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

    def token(i):
        return None if i is None else tok.convert_ids_to_tokens(i)

    eos = _turn_end_token(tok.chat_template, tok.get_vocab()) or token(special_ids["eos"])
    pad = token(special_ids["pad"]) or eos
    updates = {"bos_token": token(special_ids["bos"]), "eos_token": eos, "pad_token": pad}
    tok.add_special_tokens({k: v for k, v in updates.items() if v is not None})
    for name, value in updates.items():
        if value is None:  # transformers may have filled it in (a llama file's eos: its bos)
            setattr(tok, name, None)
    tok.clean_up_tokenization_spaces = False  # a BPE tokenizer decodes spaces as they are
    tok.save_pretrained(str(out))
    ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    return ids


def convert(gguf_path: str | Path, out: str | Path, dtype: str = "float32",
            sampling: dict | None = None) -> Path:
    """Writes the Hugging Face checkpoint of `gguf_path` into `out` and returns `out`.
    `sampling` (generation_config.json keys) sets or overrides the file's recommended sampling."""
    from safetensors.torch import save_file

    gguf_path, out = Path(gguf_path), Path(out)
    model = read_gguf(gguf_path)
    out.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(gguf_path, out, model.special_ids)
    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    state = {k: v.to(torch_dtype).contiguous() for k, v in model.state.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = dict(model.config, torch_dtype=dtype, **ids)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": ids["bos_token_id"], "eos_token_id": ids["eos_token_id"],
                  "pad_token_id": ids["pad_token_id"]}
    recommended = {**model.sampling, **(sampling or {})}
    if recommended:
        generation.update(do_sample=True, **{k: recommended[k] for k in SAMPLING_KEYS.values() if k in recommended})
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out


def parse_sampling(items: list[str], ap: argparse.ArgumentParser) -> dict:
    """`--sampling temperature=0.2 --sampling top_k=40` -> {"temperature": 0.2, "top_k": 40}."""
    sampling = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in SAMPLING_KEYS.values():
            ap.error(f"--sampling {item!r}: expected KEY=VALUE with KEY one of {', '.join(SAMPLING_KEYS.values())}")
        try:
            sampling[key] = int(value) if key == "top_k" else float(value)
        except ValueError:
            ap.error(f"--sampling {item!r}: {value!r} is not {'an integer' if key == 'top_k' else 'a number'}")
    return sampling


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, type=Path, help="the .gguf file")
    ap.add_argument("--out", required=True, type=Path, help="the checkpoint directory to write")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    ap.add_argument("--sampling", action="append", default=[], metavar="KEY=VALUE",
                    help=f"recommended sampling for generation_config.json ({', '.join(SAMPLING_KEYS.values())}); "
                         f"overrides the file's")
    args = ap.parse_args(argv)
    try:
        out = convert(args.gguf, args.out, args.dtype, parse_sampling(args.sampling, ap))
    except GGUFError as e:
        print(f"convert_gguf: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
