"""The loaders read the upstream checkpoint layouts exactly.

Tiny random checkpoints are written here in each upstream layout (key names, config
keys, file names: Hugging Face Llama sharded safetensors and `.bin`, EAGLE-1's
`pytorch_model.bin`, EAGLE-3's with `d2t`/`t2d`, Medusa's `medusa_lm_head.pt` and
`.safetensors`) and loaded by the engine's own code, which must reproduce a reference
forward written against the upstream formulas.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.errors import ConfigError
from specdec.models.eagle import EagleHead
from specdec.models.eagle3 import Eagle3Head
from specdec.models.layers import causal_mask
from specdec.models.llama import LlamaModel
from specdec.models.medusa import MedusaHeads

from engine_helpers import prefill_logits

H, V, HEADS, KV, INTER = 64, 96, 4, 2, 128


def _hf_config(**kw) -> LlamaConfig:
    base = dict(vocab_size=V, hidden_size=H, intermediate_size=INTER, num_hidden_layers=6,
                num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=256,
                rms_norm_eps=1e-5, tie_word_embeddings=False)
    base.update(kw)
    return LlamaConfig(**base)


@pytest.mark.parametrize("layout", ["safetensors-sharded", "bin", "tied", "llama3-rope", "qwen2"])
def test_llama_layouts_match_transformers(tmp_path, layout):
    torch.manual_seed(0)
    kw = {}
    if layout == "tied":
        kw["tie_word_embeddings"] = True
    if layout == "llama3-rope":
        kw["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    if layout == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM
        cfg = Qwen2Config(vocab_size=V, hidden_size=H, intermediate_size=INTER, num_hidden_layers=3,
                          num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=256,
                          tie_word_embeddings=False)
        hf = Qwen2ForCausalLM(cfg).eval()
    else:
        hf = LlamaForCausalLM(_hf_config(**kw)).eval()
    if layout == "bin":  # transformers 5 writes only safetensors: write the old layout by hand
        hf.config.save_pretrained(tmp_path)
        torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    else:
        hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    if layout == "safetensors-sharded":
        assert (tmp_path / "model.safetensors.index.json").exists()
    ours = LlamaModel.from_pretrained(tmp_path)
    ids = torch.randint(0, V, (1, 40))
    with torch.no_grad():
        ref = hf(ids).logits
    assert torch.allclose(prefill_logits(ours, ids), ref, atol=1e-4), layout


def test_fused_projections_hold_each_weight_once(tmp_path):
    """Serving fuses q/k/v and gate/up into one matmul each; the separate modules stay
    (state-dict names) as views, so memory is the checkpoint's, not ~1.7x it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM  # q/k/v with biases

    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(vocab_size=V, hidden_size=H, intermediate_size=INTER, num_hidden_layers=2,
                                      num_attention_heads=HEADS, num_key_value_heads=KV,
                                      tie_word_embeddings=False)).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = LlamaModel.from_pretrained(tmp_path)
    assert ours.model.layers[0].self_attn.qkv is not None and ours.model.layers[0].mlp.gate_up is not None
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in ours.parameters()}
    checkpoint = sum(t.numel() * t.element_size() for t in hf.state_dict().values())
    assert sum(storages.values()) == checkpoint
    sd = ours.state_dict()  # the upstream names still read the weights
    attn = hf.model.layers[1].self_attn
    assert torch.equal(sd["model.layers.1.self_attn.k_proj.weight"], attn.k_proj.weight)
    assert torch.equal(sd["model.layers.1.self_attn.v_proj.bias"], attn.v_proj.bias)


def test_llama_mismatched_checkpoint_is_a_config_error(tmp_path):
    hf = LlamaForCausalLM(_hf_config())
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 7
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="does not match its config"):
        LlamaModel.from_pretrained(tmp_path)


def _rms(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta=10000.0):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    f = pos[:, None].float() * inv[None]
    emb = torch.cat((f, f), -1)
    rot = torch.cat((-x[..., d // 2:], x[..., : d // 2]), -1)
    return x * emb.cos() + rot * emb.sin()


def _ref_attention(sd, prefix, x, pos):
    """Upstream-formula causal attention of one layer with GQA; x: [T, in]."""
    T = x.shape[0]
    q = (x @ sd[f"{prefix}q_proj.weight"].T).view(T, HEADS, -1).transpose(0, 1)
    k = (x @ sd[f"{prefix}k_proj.weight"].T).view(T, KV, -1).transpose(0, 1)
    v = (x @ sd[f"{prefix}v_proj.weight"].T).view(T, KV, -1).transpose(0, 1)
    q, k = _rope(q, pos), _rope(k, pos)
    k, v = k.repeat_interleave(HEADS // KV, 0), v.repeat_interleave(HEADS // KV, 0)
    att = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    return (att @ v).transpose(0, 1).reshape(T, -1) @ sd[f"{prefix}o_proj.weight"].T


def _ref_mlp(sd, prefix, x):
    return (F.silu(x @ sd[f"{prefix}gate_proj.weight"].T) * (x @ sd[f"{prefix}up_proj.weight"].T)) \
        @ sd[f"{prefix}down_proj.weight"].T


def _head_config(**kw):
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=H, intermediate_size=INTER,
               num_attention_heads=HEADS, num_key_value_heads=KV, num_hidden_layers=1, vocab_size=V,
               rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256, hidden_act="silu")
    cfg.update(kw)
    return cfg


def _rand(*shape):
    return torch.randn(*shape) * 0.1


def _layer_weights(prefix, in_features, input_norm=True):
    sd = {f"{prefix}self_attn.q_proj.weight": _rand(H, in_features),
          f"{prefix}self_attn.k_proj.weight": _rand(H // HEADS * KV, in_features),
          f"{prefix}self_attn.v_proj.weight": _rand(H // HEADS * KV, in_features),
          f"{prefix}self_attn.o_proj.weight": _rand(H, H),
          f"{prefix}mlp.gate_proj.weight": _rand(INTER, H),
          f"{prefix}mlp.up_proj.weight": _rand(INTER, H),
          f"{prefix}mlp.down_proj.weight": _rand(H, INTER),
          f"{prefix}post_attention_layernorm.weight": 1 + _rand(H)}
    if input_norm:
        sd[f"{prefix}input_layernorm.weight"] = 1 + _rand(H)
    return sd


@pytest.fixture()
def base_dir(tmp_path):
    torch.manual_seed(1)
    d = tmp_path / "base"
    LlamaForCausalLM(_hf_config()).save_pretrained(d, safe_serialization=True, max_shard_size="100KB")
    return d


@pytest.mark.parametrize("with_embed", [True, False])
def test_eagle1_layout(tmp_path, base_dir, with_embed):
    torch.manual_seed(2)
    sd = {"fc.weight": _rand(H, 2 * H), "fc.bias": _rand(H)}
    sd.update(_layer_weights("layers.0.", H, input_norm=False))  # EAGLE-1: no input_layernorm
    embed = _rand(V, H)
    if with_embed:
        sd["embed_tokens.weight"] = embed
    else:
        from specdec.models.checkpoint import load_tensor
        embed = load_tensor(base_dir, "model.embed_tokens.weight")
    d = tmp_path / "eagle"
    d.mkdir()
    torch.save(sd, d / "pytorch_model.bin")
    (d / "config.json").write_text(json.dumps(_head_config(bias=True)))
    head = EagleHead.from_pretrained(d, base_dir)

    T = 9
    ids, feats, pos = torch.randint(0, V, (T,)), torch.randn(T, H), torch.arange(T)
    x = torch.cat((embed[ids], feats), -1) @ sd["fc.weight"].T + sd["fc.bias"]
    x = x + _ref_attention(sd, "layers.0.self_attn.", x, pos)
    x = x + _ref_mlp(sd, "layers.0.mlp.", _rms(x, sd["layers.0.post_attention_layernorm.weight"]))
    with torch.no_grad():
        ours = head(ids[None], feats[None], pos[None], causal_mask(1, T, "cpu")[:, None])[0]
    assert torch.allclose(ours, x, atol=1e-5)


@pytest.mark.parametrize("file_name", ["pytorch_model.bin", "model.safetensors"])
def test_eagle3_layout(tmp_path, base_dir, file_name):
    torch.manual_seed(3)
    DV = 40
    sd = {"fc.weight": _rand(H, 3 * H), "norm.weight": 1 + _rand(H), "lm_head.weight": _rand(DV, H),
          "midlayer.hidden_norm.weight": 1 + _rand(H)}
    sd.update(_layer_weights("midlayer.", 2 * H))
    draft_ids = torch.sort(torch.randperm(V)[:DV]).values
    sd["d2t"] = draft_ids - torch.arange(DV)
    sd["t2d"] = torch.zeros(V, dtype=torch.bool)
    sd["t2d"][draft_ids] = True
    d = tmp_path / "eagle3"
    d.mkdir()
    if file_name.endswith(".bin"):
        torch.save(sd, d / file_name)
    else:
        save_file(sd, str(d / file_name))
    (d / "config.json").write_text(json.dumps(_head_config(architectures=["LlamaForCausalLMEagle3"],
                                                           draft_vocab_size=DV, target_hidden_size=H)))
    head = Eagle3Head.from_pretrained(d, base_dir)
    from specdec.models.checkpoint import load_tensor
    embed = load_tensor(base_dir, "model.embed_tokens.weight")

    T = 7
    ids, feats3, pos = torch.randint(0, V, (T,)), torch.randn(T, 3 * H), torch.arange(T)
    hidden = feats3 @ sd["fc.weight"].T
    x = torch.cat((_rms(embed[ids], sd["midlayer.input_layernorm.weight"]),
                   _rms(hidden, sd["midlayer.hidden_norm.weight"])), -1)
    h = hidden + _ref_attention(sd, "midlayer.self_attn.", x, pos)
    h = h + _ref_mlp(sd, "midlayer.mlp.", _rms(h, sd["midlayer.post_attention_layernorm.weight"]))
    logits = _rms(h, sd["norm.weight"]) @ sd["lm_head.weight"].T
    with torch.no_grad():
        out = head(ids[None], head.fc(feats3[None]), pos[None], causal_mask(1, T, "cpu")[:, None])[0]
        assert torch.allclose(out, h, atol=1e-5)
        assert torch.allclose(head.draft_logits(out), logits, atol=1e-5)
    assert torch.equal(head.to_target_ids(torch.arange(DV)), draft_ids)


@pytest.mark.parametrize("file_name", ["medusa_lm_head.pt", "medusa_lm_head.safetensors"])
def test_medusa_layout(tmp_path, file_name):
    torch.manual_seed(4)
    K, L = 3, 2
    sd = {}
    for i in range(K):
        for j in range(L):
            sd[f"{i}.{j}.linear.weight"] = _rand(H, H)
            sd[f"{i}.{j}.linear.bias"] = _rand(H)
        sd[f"{i}.{L}.weight"] = _rand(V, H)
    d = tmp_path / "medusa"
    d.mkdir()
    if file_name.endswith(".pt"):
        torch.save(sd, d / file_name)
    else:
        save_file(sd, str(d / file_name))
    (d / "config.json").write_text(json.dumps({"medusa_num_heads": K, "medusa_num_layers": L,
                                               "base_model_name_or_path": "base"}))
    heads = MedusaHeads.from_pretrained(d, H, V)
    x = torch.randn(5, H)
    with torch.no_grad():
        out = heads(x)
    for i in range(K):
        h = x
        for j in range(L):
            h = h + F.silu(h @ sd[f"{i}.{j}.linear.weight"].T + sd[f"{i}.{j}.linear.bias"])
        assert torch.allclose(out[i], h @ sd[f"{i}.{L}.weight"].T, atol=1e-5)
    # cut at load: the heads equal the full ones cut afterwards, parameter for parameter
    rows = torch.randperm(V)[:7]
    cut = MedusaHeads.from_pretrained(d, H, V, rows=rows)
    heads.keep_rows(rows)
    assert torch.equal(cut.rows, heads.rows) and cut.state_dict().keys() == heads.state_dict().keys()
    for (name, a), b in zip(cut.state_dict().items(), heads.state_dict().values()):
        assert a.shape == b.shape and torch.equal(a, b), name
    assert not any(p.is_meta for p in cut.parameters())


def test_wrong_head_checkpoint_is_a_config_error(tmp_path, base_dir):
    d = tmp_path / "bad"
    d.mkdir()
    save_file({"fc.weight": _rand(H, 2 * H)}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(_head_config()))
    with pytest.raises(ConfigError, match="not an EAGLE-1 head"):
        EagleHead.from_pretrained(d, base_dir)
    with pytest.raises(ConfigError, match="medusa_num_heads"):
        MedusaHeads.from_pretrained(d, H, V)


def test_eagle3_on_a_base_too_shallow_for_its_feature_layers_is_a_config_error():
    """EAGLE-3 reads the inputs of base layers 2, n // 2 and n - 3; a 2-layer base has no
    layer 2, and the load says so instead of failing at the first step."""
    from types import SimpleNamespace

    from specdec.config import EngineConfig
    from specdec.drafters.loader import load_drafters

    from conftest import model_family

    family = model_family()
    shallow = SimpleNamespace(shape=SimpleNamespace(num_hidden_layers=2), lm_head=SimpleNamespace(weight=torch.zeros(1)))
    config = EngineConfig(base_model_dir=str(family / "base"), eagle3_dir=str(family / "eagle3"))
    with pytest.raises(ConfigError, match="eagle3_dir: .* at least 3 layers; this base model has 2"):
        load_drafters(config, shallow, 64, 1)
