"""Packed documents (``data.document_mask``) for every objective: a packed forward and backward equals each document
run alone (fp32, 1e-6; hypothesis over document lengths) under SDPA, flex gives the same packed logits, a row of one
document is the unpacked batch, a document holding the EOS id stays whole, and per-document semantics (seqio's
for span corruption and UL2) and statistics hold."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from objective_data import (
    ALL_OBJECTIVES,
    generators,
    packed_batch,
    rebuild,
    sentinel_set,
    tiny_model_config,
    tiny_tokenizer,
)

from pretrain import objectives
from pretrain.models.transformer import Transformer
from pretrain.objectives.loss import IGNORE_INDEX

SEQ_LEN = 40
ARCH = {
    "clm": "decoder",
    "mlm": "encoder",
    "span_corruption": "encoder-decoder",
    "prefix_lm": "decoder",
    "prefix_lm_encdec": "encoder-decoder",
    "ul2": "encoder-decoder",
}
POSITIONS = {
    "decoder": ("learned", "rope"),
    "encoder": ("learned", "rope"),
    "encoder-decoder": ("relative", "rope"),
}
CASES = [(key, position) for key, arch in ARCH.items() for position in POSITIONS[arch]]


def build(key: str) -> objectives.Objective:
    options = {**ALL_OBJECTIVES[key], **({"input_length": SEQ_LEN} if key == "ul2" else {})}
    return objectives.build(key.removesuffix("_encdec"), tiny_tokenizer(), **options)


_MODELS: dict = {}


def model(arch: str, position: str, backend: str = "sdpa") -> Transformer:
    key = (arch, position, backend)
    if key not in _MODELS:
        torch.manual_seed(0)
        config = tiny_model_config(
            arch,
            position=position,
            attention=backend,
            decoder_start_token_id=0 if arch == "encoder-decoder" else None,
        )
        _MODELS[key] = Transformer(config).eval()
        if backend != "sdpa":
            _MODELS[key].load_state_dict(model(arch, position).state_dict())
    return _MODELS[key]


def rows(
    key: str, lengths: list[list[int]], seed: int
) -> tuple[objectives.Objective, torch.Tensor, torch.Tensor]:
    """``(objective, tokens (B, L), document_ids (B, L))``: row b holds documents of ``lengths[b]`` (the last one
    runs to the row's end)."""
    obj = build(key)
    L = obj.raw_length(SEQ_LEN)
    tokens = packed_batch(len(lengths), L, seed=seed)
    documents = torch.zeros_like(tokens)
    for b, row in enumerate(lengths):
        for end in torch.tensor(row).cumsum(0).tolist():
            documents[b, end:] += 1 if end < L else 0
    return obj, tokens, documents


def spans(ids: torch.Tensor) -> dict[int, tuple[int, int]]:
    """document id -> (start, end) of one row (padding, id -1, left out)."""
    out: dict[int, tuple[int, int]] = {}
    for i, d in enumerate(ids.tolist()):
        if d >= 0:
            out[d] = (out.get(d, (i, i))[0], i + 1)
    return out


def alone(batch: dict[str, torch.Tensor]) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """Every document of a packed batch as its own one-row batch (positions from 0, no document ids): what the
    model computes for it unpacked. Prefix LM: the document's prefix as ``prefix_lengths``."""
    out = []
    for b in range(batch["input_ids"].shape[0]):
        encoder = spans(batch["document_ids"][b])
        decoder = spans(batch["decoder_document_ids"][b]) if "decoder_input_ids" in batch else None
        for d, (s, e) in encoder.items():
            kw = {"input_ids": batch["input_ids"][b : b + 1, s:e]}
            labels = batch["labels"][b : b + 1, s:e]
            if "prefix_mask" in batch:
                kw["prefix_lengths"] = batch["prefix_mask"][b : b + 1, s:e].sum(1)
            if decoder is not None:
                ds, de = decoder[d]
                kw["decoder_input_ids"] = batch["decoder_input_ids"][b : b + 1, ds:de]
                labels = batch["labels"][b : b + 1, ds:de]
            out.append((kw, labels))
    return out


def loss_and_grads(net: Transformer, pieces) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(cross-entropy of every target, in row-major order; gradients of their mean, the training loss) over
    (kwargs, labels) pieces."""
    net.zero_grad(set_to_none=True)
    losses = []
    for kw, labels in pieces:
        logits = net(**kw).logits
        keep = labels != IGNORE_INDEX
        losses.append(torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="none"))
    per_target = torch.cat(losses)
    per_target.mean().backward()
    return per_target.detach(), [p.grad.clone() for p in net.parameters() if p.grad is not None]


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in batch.items() if k != "labels"}


DOCUMENT_LENGTHS = st.lists(st.lists(st.integers(1, 30), min_size=1, max_size=5), min_size=1, max_size=3)


@pytest.mark.parametrize(("key", "position"), CASES)
@settings(max_examples=6, deadline=None)
@given(lengths=DOCUMENT_LENGTHS, seed=st.integers(0, 1000))
def test_packed_forward_and_backward_equal_each_document_alone(key, position, lengths, seed):
    obj, tokens, documents = rows(key, lengths, seed)
    batch = obj(tokens, generators(range(seed, seed + len(lengths))), documents)
    assume((batch["labels"] != IGNORE_INDEX).any())  # MLM may select nothing in a short row
    net = model(ARCH[key], position)
    packed, packed_grads = loss_and_grads(net, [(model_inputs(batch), batch["labels"])])
    separate, separate_grads = loss_and_grads(net, alone(batch))
    assert len(packed) == len(separate) == (batch["labels"] != IGNORE_INDEX).sum() > 0
    torch.testing.assert_close(packed, separate, rtol=0, atol=1e-6)  # every target's loss
    torch.testing.assert_close(packed.mean(), separate.mean(), rtol=1e-6, atol=0)
    for grad, expected in zip(packed_grads, separate_grads, strict=True):
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("key", list(ARCH))
def test_flex_block_masks_equal_sdpa_on_packed_documents(key):
    obj, tokens, documents = rows(key, [[5, 17, 3], [30], [1, 1, 9, 2]], seed=3)
    batch = model_inputs(obj(tokens, generators([1, 2, 3]), documents))
    arch, position = ARCH[key], POSITIONS[ARCH[key]][0]
    with torch.no_grad(), torch.compiler.set_stance("force_eager"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
        sdpa, flex = model(arch, position)(**batch).logits, model(arch, position, "flex")(**batch).logits
    real = (batch.get("decoder_attention_mask", batch["attention_mask"]) > 0)[..., None]
    torch.testing.assert_close(flex * real, sdpa * real, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("key", list(ARCH))
def test_a_row_of_one_document_is_the_unpacked_batch(key):
    obj, tokens, _ = rows(key, [[1000]] * 3, seed=5)
    plain = obj(tokens, generators([4, 5, 6]))
    packed = obj(tokens, generators([4, 5, 6]), torch.zeros_like(tokens))
    assert set(plain) - set(packed) <= {"prefix_lengths"}
    for k, value in plain.items():
        if k in packed:
            assert torch.equal(value, packed[k]), k
    assert not packed["document_ids"].clamp_min(0).any()  # one document (padding: -1)


def test_a_document_holding_the_eos_id_stays_whole():
    """Boundaries come from the data: an EOS id inside a document (as a corpus of an older format could hold) does
    not split it, for causal LM (which used to find boundaries by that id) and prefix LM alike."""
    eos = tiny_tokenizer().token_to_id("</s>")
    for key in ("clm", "prefix_lm"):
        obj, tokens, documents = rows(key, [[20]], seed=1)
        tokens[0, 5] = tokens[0, 11] = eos  # inside the first document
        batch = obj(tokens, generators([0]), documents)
        assert batch["document_ids"][0, :19].eq(0).all() and batch["position_ids"][0, :19].tolist() == list(
            range(19)
        )


def test_span_corruption_corrupts_each_document_as_t5_with_seqio_packing():
    tok = tiny_tokenizer()
    pad, eos = tok.token_to_id("<pad>"), tok.token_to_id("</s>")
    sentinels = sentinel_set(tok)
    obj, tokens, documents = rows("span_corruption", [[20, 25, 9], [1, 40], [60]], seed=2)
    batch = obj(tokens, generators([7, 8, 9]), documents)
    for b in range(3):
        encoder, decoder = spans(batch["document_ids"][b]), spans(batch["decoder_document_ids"][b])
        assert encoder.keys() == decoder.keys()
        for d, (s, e) in encoder.items():
            inputs = batch["input_ids"][b, s:e].tolist()
            ds, de = decoder[d]
            targets = batch["labels"][b, ds:de].tolist()
            assert inputs[-1] == eos and targets[-1] == eos
            used = [sentinels[t] for t in inputs if t in sentinels]
            assert used == list(range(len(used)))  # numbered from <extra_id_0> in every document
            raw = tokens[b][documents[b] == d].tolist()
            original = rebuild(inputs, targets, sentinels)
            assert original == raw[: len(original)] and (len(original) == len(raw) or d == max(encoder))
            assert batch["decoder_input_ids"][b, ds] == pad  # decoder input 0 at every document start
            assert batch["decoder_input_ids"][b, ds + 1 : de].tolist() == targets[:-1]
            assert batch["position_ids"][b, s:e].tolist() == list(range(e - s))
            assert batch["decoder_position_ids"][b, ds:de].tolist() == list(range(de - ds))
        padding = batch["document_ids"][b] < 0
        assert (batch["attention_mask"][b] == ~padding).all() and (
            batch["input_ids"][b][padding] == pad
        ).all()


def test_span_corruption_noise_density_and_span_length_hold_per_document():
    """Each document of a packed row gets T5's counts for its own length: noise = round(n * 0.15), spans =
    round(noise / 3), over many rows of random document lengths."""
    sentinels = sentinel_set(tiny_tokenizer())
    g = torch.Generator().manual_seed(0)
    lengths = [torch.randint(1, 40, (6,), generator=g).tolist() for _ in range(80)]
    obj, tokens, documents = rows("span_corruption", lengths, seed=4)
    batch = obj(tokens, generators(range(80)), documents)
    noise = total = 0
    for b in range(80):
        encoder, decoder = spans(batch["document_ids"][b]), spans(batch["decoder_document_ids"][b])
        for d, (s, e) in encoder.items():
            inputs, targets = (
                batch["input_ids"][b, s:e].tolist(),
                batch["labels"][b, slice(*decoder[d])].tolist(),
            )
            n = len(rebuild(inputs, targets, sentinels))
            counted = (
                sum(t not in sentinels for t in targets[:-1]),
                sum(t in sentinels for t in targets[:-1]),
            )
            expected = objectives.span_corruption.span_counts(n, 0.15, 3.0) if n >= 2 else (0, 1, 1)
            assert counted == (expected[0], expected[2]), (n, counted, expected)
            if n >= 20:  # T5 rounds each document's count: short ones are noisier by construction
                noise, total = noise + counted[0], total + n
    assert total > 1000 and abs(noise / total - 0.15) < 0.01


def test_mlm_statistics_hold_per_document():
    """15 % of each document's tokens selected (each document of the rows, and their first tokens), 80/10/10 of
    them masked / random / kept, spans never continuing across a document start."""
    tok = tiny_tokenizer()
    obj = objectives.build("mlm", tok)
    L = obj.raw_length(256)
    tokens = packed_batch(64, L, seed=0)
    documents = (torch.arange(L) // 37).expand(64, -1)  # documents of 37 tokens
    batch = obj(tokens, generators(range(64)), documents.contiguous())
    selected = batch["labels"] != IGNORE_INDEX
    special = objectives.base.special_id_table(tok)[torch.cat([tokens[:, :1], tokens, tokens[:, -1:]], 1)]
    for d in range(int(documents.max()) + 1):  # every document of the row, the one cut by the row's end too
        in_doc = (batch["document_ids"] == d) & ~special
        assert abs(selected[in_doc].float().mean() - 0.15) < 0.025, d
    starts = torch.zeros_like(selected)
    starts[:, 1:] = batch["document_ids"][:, 1:] != batch["document_ids"][:, :-1]
    assert abs(selected[starts & ~special].float().mean() - 0.15) < 0.05  # no bias at a document's start
    masked = (batch["input_ids"] == tok.token_to_id("<mask>")) & selected
    kept = (batch["input_ids"] == batch["labels"]) & selected
    replaced = selected & ~masked & ~kept  # a random token (one drawn equal to the original counts as kept)
    assert abs(masked.sum() / selected.sum() - 0.8) < 0.03
    assert abs(replaced.sum() / selected.sum() - 0.1) < 0.02 and abs(kept.sum() / selected.sum() - 0.1) < 0.02
    span = objectives.build("mlm", tok, span_masking=True)
    batch = span(tokens, generators(range(64)), documents.contiguous())
    picked = batch["labels"] != IGNORE_INDEX
    assert abs(picked[(batch["document_ids"] == 0) & ~special].float().mean() - 0.15) < 0.02
    decision = torch.where(batch["input_ids"] == tok.token_to_id("<mask>"), 1, 0)
    decision = decision.masked_fill(picked & (batch["input_ids"] != batch["labels"]) & (decision == 0), 2)
    pairs = picked[:, :-1] & picked[:, 1:]  # neighbours both selected: one run unless a document starts
    same_doc = batch["document_ids"][:, :-1] == batch["document_ids"][:, 1:]
    differ = decision[:, :-1] != decision[:, 1:]
    assert not differ[pairs & same_doc].any()  # one 80/10/10 decision per run
    assert differ[pairs & ~same_doc].any()  # a span reaching into the next document is a run of its own there


def test_ul2_draws_a_denoiser_per_document_with_its_own_t5_counts():
    """Every document of a packed UL2 row is an example of its own: its mode token is drawn with the denoisers'
    weights (R 2/7, S 1/7, X 4/7 by default), and an R or X document's noise and span counts are T5's for its
    own length under one of its mode's denoisers; S documents carry no sentinel."""
    tok = tiny_tokenizer()
    sentinels = sentinel_set(tok)
    obj = objectives.build("ul2", tok, input_length=64)
    modes = {}  # mode id -> (mode, [(density, mean span), ...])
    for d, mode_id in zip(obj.denoisers, obj.mode_ids, strict=True):
        spec = (d.get("noise_density"), d.get("mean_noise_span_length"))
        modes.setdefault(mode_id, (d["mode"], []))[1].append(spec)
    g = torch.Generator().manual_seed(0)
    L = obj.raw_length(64)
    lengths = [torch.randint(2, 30, (4,), generator=g).tolist() for _ in range(100)]
    tokens = packed_batch(len(lengths), L, seed=6)
    documents = torch.zeros_like(tokens)
    for b, row in enumerate(lengths):
        for end in torch.tensor(row).cumsum(0).tolist():
            documents[b, end:] += 1 if end < L else 0
    batch = obj(tokens, generators(range(len(lengths))), documents)
    drawn = {"R": 0, "S": 0, "X": 0}
    mixed = 0  # rows whose documents drew different modes
    for b in range(len(lengths)):
        encoder, decoder = spans(batch["document_ids"][b]), spans(batch["decoder_document_ids"][b])
        assert encoder.keys() == decoder.keys()
        row_modes: set[str] = set()
        for d, (s, e) in encoder.items():
            inputs = batch["input_ids"][b, s:e].tolist()
            targets = batch["labels"][b, slice(*decoder[d])].tolist()
            mode, specs = modes[inputs[0]]
            drawn[mode] += 1
            row_modes.add(mode)
            if mode == "S":
                assert not any(t in sentinels for t in inputs + targets)
                continue
            n = len(rebuild(inputs[1:], targets, sentinels))
            counted = (
                sum(t not in sentinels for t in targets[:-1]),
                sum(t in sentinels for t in targets[:-1]),
            )
            allowed = [
                (c[0], c[2]) if n >= 2 else (0, 1)
                for c in (objectives.span_corruption.span_counts(max(n, 2), *spec) for spec in specs)
            ]
            assert counted in allowed, (mode, n, counted, allowed)
        mixed += len(row_modes) > 1
    total = sum(drawn.values())
    assert total > 400 and mixed > 50
    for mode, share in {"R": 2 / 7, "S": 1 / 7, "X": 4 / 7}.items():
        assert abs(drawn[mode] / total - share) < 0.06, drawn
