"""`pretrain export` output used as transformers and lm-eval users use it: decoders stop at ``</s>`` like
`pretrain generate`; an untied T5 v1.1 keeps its own LM head (and where transformers 5 re-ties it)."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers
from model_zoo import SCORING_ARCHS
from training_utils import TINY_MODEL

from pretrain.cli import main
from pretrain.models.config import ModelConfig
from pretrain.models.generation import generate
from pretrain.models.transformer import Transformer

GPT = TINY_MODEL["gpt"]  # tied embeddings (GPT-2)
LLAMA = SCORING_ARCHS["llama"]
T5_V1_1 = TINY_MODEL["t5"]  # untied: lm_head is its own matrix, decoder outputs unscaled (T5 v1.1)


@pytest.fixture(scope="module")
def tokenizer(shipped_corpus, tmp_path_factory):
    """A BPE trained as `pretrain tokenizer` trains one (every special token, ``</s>`` included)."""
    from pretrain.datamodules.tokenizer import train_bpe

    corpus = tmp_path_factory.mktemp("export") / "c.txt"
    corpus.write_text(shipped_corpus.read_text(encoding="utf-8")[:60_000], encoding="utf-8")
    return train_bpe(corpus, 448, show_progress=False)


def export(model: Transformer, tokenizer, tmp_path: Path) -> Path:
    """``model`` saved as `pretrain fit` saves ``last.ckpt`` (no special-token ids in its model config),
    then `pretrain export`-ed."""
    payload = {
        "config": {"model": asdict(model.config), "tokenizer": {"special_tokens": {}}},
        "tokenizer_json": tokenizer.to_str(),
    }
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "pretrain": payload}, tmp_path / "last.ckpt")
    assert main(["export", str(tmp_path / "last.ckpt"), str(tmp_path / "hf")]) == 0
    return tmp_path / "hf"


def _swap_rows(model: Transformer, a: int, b: int) -> None:
    """Relabel tokens ``a`` <-> ``b`` (input embedding and LM head rows): the model computes the same function
    with the two ids exchanged."""
    with torch.no_grad():
        for weight in {id(w): w for w in (model.embed.tok.weight, model.lm_head.weight)}.values():
            weight[[a, b]] = weight[[b, a]]


def _stops_at_eos_after(model: Transformer, prompt: torch.Tensor, eos: int, steps: int = 1) -> None:
    """Relabel the token the random model greedily emits after ``steps`` tokens as eos, so that generation with
    eos stops there (before ``max_new_tokens``)."""
    free = generate(model, prompt, 24, greedy=True)[0, prompt.shape[1] :].tolist()
    seen = set(prompt[0].tolist())
    for i, token in enumerate(free):
        if i >= steps and token not in seen and token != eos:
            _swap_rows(model, token, eos)
            return
        seen.add(token)
    pytest.fail(f"greedy continuation {free} has no new token after {steps} steps to relabel as eos")


@pytest.mark.parametrize("kind", [GPT, LLAMA], ids=["gpt2", "llama"])
def test_exported_decoder_stops_at_eos_like_pretrain_generate(kind, tokenizer, tmp_path):
    """config.json / generation_config.json carry the tokenizer's eos (and bos, pad): transformers'
    ``generate()`` and ``pipeline("text-generation")``, given no stop token, stop where ``pretrain generate``
    (``--eos </s>``, its default) stops -- not at ``max_new_tokens``."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=448, d_model=32, n_head=2, d_ff=64, max_seq_len=64, **kind)
    assert cfg.eos_token_id is None  # the ids come from the tokenizer, not the model config
    model = Transformer(cfg).eval()
    eos = tokenizer.token_to_id("</s>")
    prompt_text = "ROMEO: what light"
    prompt = torch.tensor([tokenizer.encode(prompt_text).ids])
    _stops_at_eos_after(model, prompt, eos)
    ours = generate(model, prompt, 20, greedy=True, eos_token_id=eos)[0, prompt.shape[1] :].tolist()
    assert eos in ours and len(ours) < 20
    ours = ours[: ours.index(eos) + 1]

    directory = export(model, tokenizer, tmp_path)
    ids = {
        "eos_token_id": eos,
        "bos_token_id": tokenizer.token_to_id("<s>"),
        "pad_token_id": tokenizer.token_to_id("<pad>"),
    }
    config = transformers.AutoConfig.from_pretrained(directory)
    generation = transformers.GenerationConfig.from_pretrained(directory)
    for key, value in ids.items():
        assert getattr(config, key) == value and getattr(generation, key) == value, key

    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    out = hf.generate(prompt, max_new_tokens=20, do_sample=False)[0, prompt.shape[1] :].tolist()
    assert out == ours
    text = transformers.pipeline("text-generation", model=str(directory), device="cpu")(
        prompt_text, max_new_tokens=20, do_sample=False
    )[0]["generated_text"]
    assert text == prompt_text + tokenizer.decode(ours, skip_special_tokens=True)


def test_untied_t5_v1_1_export_keeps_its_lm_head_until_transformers_reties_it(tokenizer, tmp_path):
    """An untied T5 v1.1 export loads in transformers with its own LM head and our logits, and lm-eval's
    ``hf`` model scores it as we do -- once it is kept untied. Where transformers 5 cannot represent it:
    ``T5Config`` forces ``tie_word_embeddings=True`` (the old ``False`` now only means "do not scale the decoder
    outputs"), so any ``tie_weights()`` call re-ties ``lm_head`` to ``shared``; lm-eval's ``HFLM`` makes that call
    after loading a path. Scores by path are then those of our model with its LM head replaced by the input
    embedding (about 15 nats per request off); given the loaded model with ``config.tie_word_embeddings=False``,
    lm-eval's scores equal ours."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from pretrain.evaluation import load_scorer
    from pretrain.evaluation.models import scorer_from_model

    torch.manual_seed(0)
    ours = Transformer(
        ModelConfig(vocab_size=448, d_model=32, n_head=2, d_ff=64, max_seq_len=48, **T5_V1_1)
    ).eval()
    assert ours.lm_head.weight.data_ptr() != ours.embed.tok.weight.data_ptr()
    directory = export(ours, tokenizer, tmp_path)

    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(directory).eval()
    assert hf.lm_head.weight.data_ptr() != hf.shared.weight.data_ptr()
    assert not hf.config.scale_decoder_outputs
    torch.testing.assert_close(hf.lm_head.weight, ours.lm_head.weight)
    ids, start = torch.tensor([tokenizer.encode("ROMEO: what light").ids]), torch.tensor([[0, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(
            hf(input_ids=ids, decoder_input_ids=start).logits,
            ours(input_ids=ids, decoder_input_ids=start).logits,
        )

    requests = [("ROMEO: what", " light"), ("JULIET:", " O Romeo")]
    instances = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(requests)]
    mine = [ll for ll, _ in load_scorer(directory, batch_size=2).loglikelihood(requests)]

    # where it breaks: the config cannot say "untied", and lm-eval re-ties the loaded model
    assert transformers.T5Config(tie_word_embeddings=False).tie_word_embeddings is True
    by_path = HFLM(pretrained=str(directory), backend="seq2seq", batch_size=2, device="cpu", dtype="float32")
    assert by_path.model.lm_head.weight.data_ptr() == by_path.model.shared.weight.data_ptr()
    theirs = [ll for ll, _ in by_path.loglikelihood(instances, disable_tqdm=True)]
    assert all(abs(a - b) > 1.0 for a, b in zip(theirs, mine, strict=True))
    retied = scorer_from_model(_with_lm_head_tied(ours), tokenizer, batch_size=2).loglikelihood(requests)
    assert theirs == pytest.approx([ll for ll, _ in retied], rel=1e-5, abs=1e-4)

    # kept untied, lm-eval's own hf model gives our scores
    hf.config.tie_word_embeddings = False  # tie_weights() is then a no-op
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    untied = HFLM(pretrained=hf, tokenizer=tok, backend="seq2seq", batch_size=2, device="cpu")
    assert untied.model.lm_head.weight.data_ptr() != untied.model.shared.weight.data_ptr()
    theirs = [ll for ll, _ in untied.loglikelihood(instances, disable_tqdm=True)]
    assert theirs == pytest.approx(mine, rel=1e-5, abs=1e-4)


def _with_lm_head_tied(model: Transformer) -> Transformer:
    """``model`` with its LM head replaced by the input embedding (what transformers' re-tying computes)."""
    import copy

    tied = copy.deepcopy(model)
    with torch.no_grad():
        tied.lm_head.weight.copy_(tied.embed.tok.weight)
    return tied


def test_fast_recipe_exports_with_equal_logits(tokenizer, tmp_path):
    """recipes/gpt-tiny-fast.yaml's model (muP with its attention multiplier, ReLU^2, untied head, zero-init
    projections, no QK-norm, no biases) goes through `pretrain export` to a GPT-2 whose logits equal ours."""
    from pretrain import config

    run, _ = config.load("recipes/gpt-tiny-fast.yaml", [f"model.vocab_size={tokenizer.get_vocab_size()}"])
    assert run.model.parametrization == "mup" and run.model.mup_attn_multiplier != 1.0
    assert not (run.model.attn_bias or run.model.mlp_bias or run.model.norm_bias)
    torch.manual_seed(0)
    model = Transformer(run.model).eval()
    for p in model.parameters():  # trained away from init (the zero-initialised projections too)
        p.data.normal_(0, 0.1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(export(model, tokenizer, tmp_path)).eval()
    ids = torch.tensor([tokenizer.encode("ROMEO: what light through yonder window breaks").ids])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-4)


def test_exported_modernbert_loads_with_auto_model_for_masked_lm(tokenizer, tmp_path):
    """`pretrain export` of a ModernBERT-layout checkpoint: AutoModelForMaskedLM (and AutoTokenizer, with the
    mask token) load the directory as ModernBertForMaskedLM with our logits."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=448, d_model=32, n_head=2, d_ff=64, max_seq_len=64, **TINY_MODEL["modernbert"]
    )
    model = Transformer(cfg).eval()
    with torch.no_grad():  # norms 1 and the decoder bias 0 at init: make a swapped norm or bias visible
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = export(model, tokenizer, tmp_path)
    hf = transformers.AutoModelForMaskedLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "ModernBertForMaskedLM"
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    batch = hf_tokenizer(
        ["ROMEO: what <mask> thou?", "To be, or not to <mask>, that is the question"],
        padding=True,
        return_tensors="pt",
    )
    assert (batch["input_ids"] == hf_tokenizer.mask_token_id).sum() == 2
    with torch.no_grad():
        ours = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        theirs = hf(**batch).logits
    real = batch["attention_mask"].bool()
    assert (ours - theirs).abs()[real].max().item() <= 1e-5
