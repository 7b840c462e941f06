"""Tiny-model presets shared by several test modules (configuration dicts for ``ModelConfig``)."""

VARIANTS = {
    "gpt": {"arch": "decoder"},
    "llama": {
        "arch": "decoder",
        "norm": "rmsnorm",
        "norm_bias": False,
        "position": "rope",
        "activation": "swiglu",
        "n_kv_head": 1,
        "mlp_bias": False,
        "attn_bias": False,
        "tie_embeddings": False,
        "init": "bert",
    },
    "sinusoidal": {
        "arch": "decoder",
        "position": "sinusoidal",
        "norm_position": "post",
        "activation": "relu",
    },
    "bert": {
        "arch": "encoder",
        "norm_position": "post",
        "embedding_norm": True,
        "type_vocab_size": 2,
        "mlm_head_transform": True,
        "lm_head_bias": True,
        "activation": "gelu",
        "init": "bert",
    },
    "t5": {
        "arch": "encoder-decoder",
        "norm": "rmsnorm",
        "norm_bias": False,
        "position": "relative",
        "attn_scale": "none",
        "activation": "geglu_tanh",
        "mlp_bias": False,
        "attn_bias": False,
        "init": "t5",
        "logit_scale": 24**-0.5,
        "n_decoder_layer": 3,
    },
    "modernbert": {  # layer 0 global, layer 1 local (window 3, its own RoPE base)
        "arch": "encoder",
        "norm_bias": False,
        "embedding_norm": True,
        "position": "rope",
        "rope_theta": 1000.0,
        "activation": "geglu",
        "mlp_bias": False,
        "attn_bias": False,
        "global_attn_every_n_layers": 2,
        "local_attention_window": 3,
        "local_rope_theta": 50.0,
        "mlm_head_transform": True,
        "mlm_head_bias": False,
        "lm_head_bias": True,
    },
    "local_decoder": {  # Gemma 2's pattern: layer 0 global, layer 1 a sliding window of 3
        "arch": "decoder",
        "position": "rope",
        "global_attn_every_n_layers": 2,
        "local_attention_window": 3,
    },
}


# tiny-model presets transformers can express too (GPT-2, Llama with GQA, T5); the lm-eval test shares them
SCORING_ARCHS = {
    "gpt": {"arch": "decoder", "position": "learned"},
    "llama": {
        "arch": "decoder",
        "position": "rope",
        "norm": "rmsnorm",
        "norm_bias": False,
        "n_kv_head": 2,
        "activation": "swiglu",
        "mlp_bias": False,
        "attn_bias": False,
        "tie_embeddings": False,
    },
    "t5": {
        "arch": "encoder-decoder",
        "position": "relative",
        "norm": "rmsnorm",
        "norm_bias": False,
        "activation": "relu",
        "mlp_bias": False,
        "attn_bias": False,
        "attn_scale": "none",
        "init": "t5",
        "decoder_start_token_id": 0,
        "pad_token_id": 0,
    },
}


def random_hf_t5(vocab_size: int, eos: int, pad: int, **config):
    """A small random transformers ``T5ForConditionalGeneration`` (seed 0; ``config`` overrides T5Config
    fields) with every parameter times 3: peaked distributions, so decoding choices are clear-cut."""
    import torch
    import transformers

    torch.manual_seed(0)
    settings = {
        "d_model": 32,
        "d_kv": 8,
        "d_ff": 48,
        "num_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 16,
    }
    cfg = transformers.T5Config(
        vocab_size=vocab_size,
        decoder_start_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
        **settings | config,
    )
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    return model
