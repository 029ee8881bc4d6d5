"""EAGLE-1 / EAGLE-3 draft heads (aioengine.spec_decode.eagle): loading the published formats
(tests/eagle_heads.py writes them), the errors naming speculative_config.model, and the
paged forward (a prefill, then two decode steps over the paged cache) against a dense torch
reference written here from the published formulas (EAGLE repo cnets1.py / cnets.py)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from eagle_heads import make_random_eagle_head_dir
from float_error import assert_as_exact_as
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_config

from aioengine.model.arch import ModelArchConfig
from aioengine.model.attention import build_attention_metadata
from aioengine.model.layers import Linear
from aioengine.spec_decode.eagle import (EagleHead, SpeculativeConfigError,
                                         default_aux_layer_ids, load_eagle_head)
from aioengine.spec_decode.eagle_checkpoint import read_checkpoint

CPU = torch.device("cpu")
NUM_LAYERS = 4
H = 64
VOCAB = 49152
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny 4-layer Llama target's config.json (the heads read no more of the target)."""
    path = tmp_path_factory.mktemp("target")
    make_tiny_config("llama", num_hidden_layers=NUM_LAYERS).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target_arch() -> ModelArchConfig:
    return ModelArchConfig.from_hf_config(make_tiny_config("llama", num_hidden_layers=NUM_LAYERS))


def _load(path: Path, method: str, arch: ModelArchConfig) -> EagleHead:
    return load_eagle_head(str(path), method, arch, torch.float32, CPU)


def _edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_weights(path: Path, **changes: torch.Tensor | None) -> None:
    """Replaces (or with None drops) tensors of model.safetensors."""
    w = load_file(str(path / "model.safetensors"))
    for name, t in changes.items():
        if t is None:
            del w[name]
        else:
            w[name] = t
    save_file(w, str(path / "model.safetensors"))


def test_default_aux_layer_ids() -> None:
    assert default_aux_layer_ids(32) == (2, 16, 29)  # vLLM's (2, L // 2, L - 3)
    assert default_aux_layer_ids(4) == (1, 2)
    assert default_aux_layer_ids(2) == (0, 1)
    assert default_aux_layer_ids(1) == (0,)


@pytest.mark.parametrize("fc_bias,input_norm", [(False, False), (True, True)])
def test_load_eagle1(tmp_path, target_dir, target_arch, fc_bias: bool, input_norm: bool) -> None:
    path = make_random_eagle_head_dir(target_dir, tmp_path, "eagle", fc_bias=fc_bias,
                                      input_layernorm=input_norm)
    head = _load(path, "eagle", target_arch)
    w = load_file(str(path / "model.safetensors"))
    assert (head.method, head.hidden_size, head.aux_layer_ids) == ("eagle", H, ())
    assert head.input_hidden_size == H
    assert head.fc is not None and torch.equal(head.fc.dense_weight(), w["fc.weight"])
    assert (head.fc.bias is not None) == fc_bias
    assert (head.layer.input_layernorm is not None) == input_norm
    assert head.lm_head is None and head.draft_to_target is None and head.norm is None
    qkv = torch.cat([w[f"layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(head.layer.qkv_proj.dense_weight(), qkv)


def test_load_eagle3(tmp_path, target_dir, target_arch) -> None:
    # Out of order in the config: concatenated in layer order, as vLLM captures them.
    path = make_random_eagle_head_dir(target_dir, tmp_path, "eagle3", draft_vocab_size=300,
                                      aux_layer_ids=[3, 1, 2])
    head = _load(path, "eagle3", target_arch)
    w = load_file(str(path / "model.safetensors"))
    assert (head.method, head.aux_layer_ids, head.input_hidden_size) == ("eagle3", (1, 2, 3),
                                                                         3 * H)
    assert head.layer.qkv_proj.in_features == 2 * H
    assert head.lm_head is not None and head.lm_head.dense_weight().shape == (300, H)
    assert torch.equal(head.draft_to_target, w["t2d"].nonzero().flatten())
    assert torch.equal(head.hidden_norm, w["midlayer.hidden_norm.weight"])
    # vLLM reads the ids at the top level first; without any, its default.
    _edit_config(path, eagle_aux_hidden_state_layer_ids=[0, 3])
    with pytest.raises(SpeculativeConfigError, match="speculative_config.model: fc.weight"):
        _load(path, "eagle3", target_arch)  # fc is 3H wide, 2 layers listed
    default = make_random_eagle_head_dir(target_dir, tmp_path / "default", "eagle3")
    head = _load(default, "eagle3", target_arch)
    assert head.aux_layer_ids == default_aux_layer_ids(NUM_LAYERS) == (1, 2)
    assert head.input_hidden_size == 2 * H
    assert head.draft_to_target is None and head.lm_head is not None  # full vocabulary


# ---- the paged forward against a dense reference -----------------------------------------

def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, heads, D], transformers' rotate_half convention."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=x.dtype) / d)
    angles = positions[:, None].to(x.dtype) * inv_freq
    angles = torch.cat((angles, angles), dim=-1)[:, None]  # [T, 1, D]
    cos, sin = angles.cos(), angles.sin()
    rotated = torch.cat((-x[..., d // 2:], x[..., :d // 2]), dim=-1)
    return x * cos + rotated * sin


def _dense_attention(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str,
                     cfg: dict) -> torch.Tensor:
    """Full causal attention over the whole sequence x [T, in], no cache."""
    t, heads, kv_heads = x.shape[0], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // heads
    pos = torch.arange(t)
    theta = cfg["rope_parameters"]["rope_theta"]
    q = _rope((x @ w[prefix + "self_attn.q_proj.weight"].T).view(t, heads, d), pos, theta)
    k = _rope((x @ w[prefix + "self_attn.k_proj.weight"].T).view(t, kv_heads, d), pos, theta)
    v = (x @ w[prefix + "self_attn.v_proj.weight"].T).view(t, kv_heads, d)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("thd,shd->hts", q, k) * d ** -0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, heads * d)
    return o @ w[prefix + "self_attn.o_proj.weight"].T


def _mlp(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    gate, up = x @ w[prefix + "mlp.gate_proj.weight"].T, x @ w[prefix + "mlp.up_proj.weight"].T
    return (F.silu(gate) * up) @ w[prefix + "mlp.down_proj.weight"].T


def _reference(method: str, w: dict[str, torch.Tensor], cfg: dict, emb: torch.Tensor,
               hiddens: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits_hidden, next_hidden) at every position, from the published formulas."""
    if method == "eagle":  # cnets1.py: fc([emb, hidden]), layer 0 without an input norm
        p = "layers.0."
        x = torch.cat((emb, torch.cat(hiddens)), -1) @ w["fc.weight"].T
        if "fc.bias" in w:
            x = x + w["fc.bias"]
        a = _rms(x, w[p + "input_layernorm.weight"]) if p + "input_layernorm.weight" in w else x
        x = x + _dense_attention(a, w, p, cfg)
        x = x + _mlp(_rms(x, w[p + "post_attention_layernorm.weight"]), w, p)
        return x, x
    p = "midlayer."  # cnets.py: residual = fc'ed hidden; [input_layernorm(emb), hidden_norm]
    h = torch.cat([x if x.shape[-1] == H else x @ w["fc.weight"].T for x in hiddens])
    normed = _rms(h, w[p + "hidden_norm.weight"])
    residual = normed if cfg.get("norm_before_residual") else h
    a = torch.cat((_rms(emb, w[p + "input_layernorm.weight"]), normed), -1)
    x = residual + _dense_attention(a, w, p, cfg)
    x = x + _mlp(_rms(x, w[p + "post_attention_layernorm.weight"]), w, p)
    return _rms(x, w["norm.weight"]), x


# name -> (method, helper kwargs, norm_before_residual)
CASES = {
    "eagle": ("eagle", {}, False),
    "eagle-bias-input-norm": ("eagle", {"fc_bias": True, "input_layernorm": True}, False),
    "eagle3": ("eagle3", {"draft_vocab_size": 500, "aux_layer_ids": [0, 2, 3]}, False),
    "eagle3-norm-before-residual": ("eagle3", {}, True),
}


@pytest.mark.parametrize("case", CASES)
def test_paged_forward_matches_dense_reference(tmp_path, target_dir, target_arch,
                                               case: str) -> None:
    """A prefill of 5 tokens, then 2 single-token decode steps over shuffled blocks; the
    EAGLE-3 steps take the target's aux states, the last one an H-wide hidden (what a
    second draft step feeds back: fc not applied again)."""
    method, kwargs, norm_before_residual = CASES[case]
    path = make_random_eagle_head_dir(target_dir, tmp_path, method, seed=3, **kwargs)
    if norm_before_residual:
        _edit_config(path, norm_before_residual=True)
    head = _load(path, method, target_arch)
    w = load_file(str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    gen = torch.Generator().manual_seed(0)
    embed = Linear(H, VOCAB, False, dtype=torch.float32, device=CPU)
    embed.weight.copy_(0.2 * torch.randn(VOCAB, H, generator=gen))
    steps = [5, 1, 1]
    width = head.input_hidden_size
    widths = [width, width, H if method == "eagle3" else width]
    tokens = torch.randint(VOCAB, (sum(steps),), generator=gen)
    hiddens = [torch.randn(n, wd, generator=gen) for n, wd in zip(steps, widths)]

    kv_cache = head.make_kv_cache(num_blocks=8, block_size=BLOCK_SIZE)
    blocks = [6, 1, 3]
    outs, done = [], 0
    with torch.inference_mode():
        for n, hidden in zip(steps, hiddens):
            meta, positions = build_attention_metadata([n], [done + n], [blocks], BLOCK_SIZE, CPU)
            outs.append(head(tokens[done:done + n], hidden, positions, kv_cache, meta, embed))
            done += n
    logits_hidden = torch.cat([o[0] for o in outs])
    next_hidden = torch.cat([o[1] for o in outs])
    ref_logits_hidden, ref_next = _reference(method, w, cfg, embed.weight[tokens], hiddens)
    exact_logits_hidden, exact_next = _reference(
        method, {k: v.double() for k, v in w.items()}, cfg, embed.weight[tokens].double(),
        [h.double() for h in hiddens])
    assert_as_exact_as(next_hidden, ref_next, exact_next)
    assert_as_exact_as(logits_hidden, ref_logits_hidden, exact_logits_hidden)


# ---- logits --------------------------------------------------------------------------------

def test_compute_logits_maps_draft_ids_to_target_ids(tmp_path, target_dir, target_arch) -> None:
    path = make_random_eagle_head_dir(target_dir, tmp_path, "eagle3", draft_vocab_size=200)
    head = _load(path, "eagle3", target_arch)
    w = load_file(str(path / "model.safetensors"))
    target_head = Linear(H, VOCAB, False, dtype=torch.float32, device=CPU)
    target_head.weight.zero_()  # must not be read
    hidden = torch.randn(3, H, generator=torch.Generator().manual_seed(1))
    logits = head.compute_logits(hidden, target_head)
    assert logits.shape == (3, VOCAB) and logits.dtype == torch.float32
    draft = hidden @ w["lm_head.weight"].T  # [3, 200]
    target_ids = torch.arange(200) + w["d2t"]
    torch.testing.assert_close(logits[:, target_ids], draft, atol=1e-5, rtol=1e-5)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[target_ids] = False
    assert torch.isneginf(logits[:, outside]).all()
    best = draft.argmax(-1)
    assert torch.equal(logits.argmax(-1), best + w["d2t"][best])
    assert torch.equal(head.draft_argmax(hidden, target_head), best + w["d2t"][best])


def test_compute_logits_eagle1_uses_target_lm_head(tmp_path, target_dir, target_arch) -> None:
    head = _load(make_random_eagle_head_dir(target_dir, tmp_path, "eagle"), "eagle", target_arch)
    target_head = Linear(H, VOCAB, False, dtype=torch.float32, device=CPU)
    target_head.weight.copy_(torch.randn(VOCAB, H, generator=torch.Generator().manual_seed(2)))
    hidden = torch.randn(2, H)
    torch.testing.assert_close(head.compute_logits(hidden, target_head),
                               hidden @ target_head.weight.T, atol=1e-4, rtol=1e-5)
    assert torch.equal(head.draft_argmax(hidden, target_head),
                       (hidden @ target_head.weight.T).argmax(-1))


# ---- errors --------------------------------------------------------------------------------

def test_missing_path_and_weights(tmp_path, target_dir, target_arch) -> None:
    with pytest.raises(SpeculativeConfigError, match="speculative_config.model: no directory"):
        _load(tmp_path / "nowhere", "eagle", target_arch)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpeculativeConfigError, match="speculative_config.model: .*config.json"):
        _load(tmp_path / "empty", "eagle", target_arch)
    path = make_random_eagle_head_dir(target_dir, tmp_path / "h", "eagle")
    (path / "model.safetensors").unlink()
    with pytest.raises(SpeculativeConfigError, match="speculative_config.model: .*no weights"):
        _load(path, "eagle", target_arch)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_hidden_size_and_vocab_mismatch(tmp_path, target_dir, target_arch, method: str) -> None:
    path = make_random_eagle_head_dir(target_dir, tmp_path, method)
    wider = dataclasses.replace(target_arch, hidden_size=2 * H)
    with pytest.raises(SpeculativeConfigError,
                       match="speculative_config.model: .*hidden_size 64 differs .* 128"):
        _load(path, method, wider)
    other_vocab = dataclasses.replace(target_arch, vocab_size=VOCAB + 8)
    with pytest.raises(SpeculativeConfigError, match="speculative_config.model: .*vocab_size"):
        _load(path, method, other_vocab)


def test_d2t_must_fit_the_target_vocabulary(tmp_path, target_dir, target_arch) -> None:
    path = make_random_eagle_head_dir(target_dir, tmp_path, "eagle3", draft_vocab_size=100)
    d2t = load_file(str(path / "model.safetensors"))["d2t"]
    _edit_weights(path, d2t=d2t + VOCAB)  # past the end
    with pytest.raises(SpeculativeConfigError, match="speculative_config.model: d2t maps"):
        _load(path, "eagle3", target_arch)
    _edit_weights(path, d2t=-torch.arange(100))  # every draft id onto target id 0
    with pytest.raises(SpeculativeConfigError, match="speculative_config.model: d2t maps"):
        _load(path, "eagle3", target_arch)
    _edit_weights(path, d2t=None)
    with pytest.raises(SpeculativeConfigError, match="speculative_config.model: .*needs the d2t"):
        _load(path, "eagle3", target_arch)
    _edit_config(path, draft_vocab_size=VOCAB + 1)
    with pytest.raises(SpeculativeConfigError,
                       match="speculative_config.model: draft_vocab_size .* does not fit"):
        _load(path, "eagle3", target_arch)


def test_unknown_missing_and_misshapen_weights(tmp_path, target_dir, target_arch) -> None:
    path = make_random_eagle_head_dir(target_dir, tmp_path, "eagle")
    _edit_weights(path, **{"layers.0.extra.weight": torch.zeros(3)})
    with pytest.raises(SpeculativeConfigError,
                       match=r"speculative_config.model: unexpected weight.*layers\.0\.extra"):
        _load(path, "eagle", target_arch)
    _edit_weights(path, **{"layers.0.extra.weight": None, "layers.0.mlp.up_proj.weight": None})
    with pytest.raises(SpeculativeConfigError,
                       match=r"speculative_config.model: .*missing .*mlp\.up_proj"):
        _load(path, "eagle", target_arch)
    _edit_weights(path, **{"layers.0.mlp.up_proj.weight": torch.zeros(3, H)})
    with pytest.raises(SpeculativeConfigError, match=r"speculative_config.model: .*shape"):
        _load(path, "eagle", target_arch)
    # An EAGLE-3 head read as EAGLE-1: its names are unknown there, with a hint.
    eagle3 = make_random_eagle_head_dir(target_dir, tmp_path / "e3", "eagle3")
    with pytest.raises(SpeculativeConfigError, match="speculative_config.model: .*'eagle3'"):
        _load(eagle3, "eagle", target_arch)


def test_fc_width_must_match_the_aux_layers(tmp_path, target_dir, target_arch) -> None:
    eagle3 = make_random_eagle_head_dir(target_dir, tmp_path / "e3", "eagle3")
    _edit_weights(eagle3, **{"fc.weight": torch.zeros(H, 3 * H)})  # 3 aux layers' width
    with pytest.raises(SpeculativeConfigError,
                       match=r"fc.weight takes 192 inputs, expected 128 \(2 aux layers"):
        _load(eagle3, "eagle3", target_arch)
    eagle1 = make_random_eagle_head_dir(target_dir, tmp_path / "e1", "eagle")
    _edit_weights(eagle1, **{"fc.weight": torch.zeros(H, 3 * H)})
    with pytest.raises(SpeculativeConfigError,
                       match=r"fc.weight takes 192 inputs, expected 128 \(2 x hidden size"):
        _load(eagle1, "eagle", target_arch)


def test_read_checkpoint_gives_the_head_options(tmp_path, target_dir, target_arch) -> None:
    path = make_random_eagle_head_dir(target_dir, tmp_path, "eagle3", draft_vocab_size=100)
    ckpt = read_checkpoint(str(path), "eagle3", target_arch)
    assert (ckpt.aux_layer_ids, ckpt.draft_vocab_size) == (default_aux_layer_ids(NUM_LAYERS),
                                                           100)
    assert ckpt.input_layernorm and not ckpt.fc_bias and ckpt.arch.hidden_size == H
    d2t = ckpt.draft_to_target()
    assert d2t is not None and d2t.shape == (100,) and bool((d2t.diff() > 0).all())
    eagle1 = make_random_eagle_head_dir(target_dir, tmp_path / "e1", "eagle", fc_bias=True)
    ckpt = read_checkpoint(str(eagle1), "eagle", target_arch)
    assert (ckpt.aux_layer_ids, ckpt.draft_vocab_size, ckpt.fc_bias) == ((), None, True)
    assert not ckpt.input_layernorm and ckpt.draft_to_target() is None


def test_aux_layer_ids_out_of_range(tmp_path, target_dir, target_arch) -> None:
    path = make_random_eagle_head_dir(target_dir, tmp_path, "eagle3",
                                      aux_layer_ids=[1, 2, NUM_LAYERS])
    with pytest.raises(SpeculativeConfigError,
                       match="speculative_config.model: eagle_aux_hidden_state_layer_ids"):
        _load(path, "eagle3", target_arch)


def test_pytorch_model_bin_and_bf16_storage(tmp_path, target_dir, target_arch) -> None:
    """The EAGLE repo's pytorch_model.bin (tensors only) loads as its safetensors do; bf16
    storage keeps float32 activations on the CPU, as the target's loader does."""
    path = make_random_eagle_head_dir(target_dir, tmp_path, "eagle3", draft_vocab_size=100)
    w = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    torch.save(w, path / "pytorch_model.bin")
    head = _load(path, "eagle3", target_arch)
    assert torch.equal(head.fc.dense_weight(), w["fc.weight"])
    head16 = load_eagle_head(str(path), "eagle3", target_arch, torch.bfloat16, CPU)
    assert head16.dtype == torch.float32
    assert {lin.weight.dtype for lin in head16.linears()} == {torch.bfloat16}
    assert head16.make_kv_cache(2, BLOCK_SIZE).dtype == torch.float32
