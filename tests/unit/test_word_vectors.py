"""Word-vector evaluation and export: neighbours, analogies (inputs excluded), Spearman, word2vec text format."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pretrain.models.word_vectors import (
    GloVeModel,
    Word2Vec,
    WordVectors,
    rank,
    read_analogies,
    read_similarity,
    spearman,
    word_tokenizer,
)


def toy() -> WordVectors:
    words = ["king", "queen", "man", "woman", "apple"]
    vectors = torch.tensor(
        [[1.0, 1.0, 0.1], [1.0, -1.0, 0.1], [0.2, 1.0, 0.0], [0.2, -1.0, 0.0], [0.0, 0.0, 1.0]]
    )
    return WordVectors(vectors, words)


def test_nearest_neighbours_rank_by_cosine_and_exclude_the_query():
    wv = toy()
    got = wv.nearest("king", k=4)
    unit = torch.nn.functional.normalize(wv.raw, dim=-1)
    cos = (unit @ unit[0]).tolist()
    expected = sorted(((w, c) for w, c in zip(wv.words, cos) if w != "king"), key=lambda x: -x[1])
    assert [w for w, _ in got] == [w for w, _ in expected]
    assert [c for _, c in got] == pytest.approx([c for _, c in expected])


def test_analogy_excludes_its_input_words():
    wv = toy()
    assert wv.analogy("man", "woman", "king")[0][0] == "queen"
    # b - a + c is closest to c itself here, yet the answer must be another word
    wv2 = WordVectors(torch.tensor([[1.0, 0.0], [1.0, 0.01], [0.0, 1.0], [0.7, 0.7]]), ["a", "b", "c", "d"])
    answers = [w for w, _ in wv2.analogy("a", "b", "c", k=1)]
    assert answers == ["d"]
    assert wv.analogy_accuracy([("man", "woman", "king", "queen"), ("man", "woman", "king", "zzz")]) == {
        "analogy_accuracy": 1.0,
        "analogy_questions": 1,
        "analogy_skipped": 1,
    }
    with pytest.raises(KeyError, match="not in the vocabulary"):
        wv.analogy("man", "woman", "prince")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.floats(-10, 10, allow_nan=False)), min_size=3, max_size=30))
def test_spearman_matches_scipy(pairs):
    import scipy.stats as scipy_stats

    x, y = [float(a) for a, _ in pairs], [b for _, b in pairs]
    if len(set(x)) < 2 or len(set(y)) < 2:
        return
    assert spearman(x, y) == pytest.approx(scipy_stats.spearmanr(x, y).statistic, abs=1e-9)
    np.testing.assert_allclose(rank(np.array(x)), scipy_stats.rankdata(x))


def test_similarity_correlation_on_known_pairs_only():
    wv = toy()
    pairs = [("king", "queen", 5.0), ("king", "man", 8.0), ("man", "apple", 1.0), ("king", "unknown", 3.0)]
    result = wv.similarity_correlation(pairs)
    assert result["similarity_pairs"] == 3 and result["similarity_skipped"] == 1
    sims = [wv.similarity(a, b) for a, b, _ in pairs[:3]]
    assert result["similarity_spearman"] == pytest.approx(spearman(sims, [5.0, 8.0, 1.0]))
    with pytest.raises(ValueError, match="need >= 2"):
        wv.similarity_correlation([("king", "nope", 1.0)])


def test_word2vec_text_format_round_trip(tmp_path):
    wv = toy()
    path = wv.save_word2vec(tmp_path / "vectors.txt")
    lines = path.read_text().splitlines()
    assert lines[0] == "5 3"
    assert lines[1].split()[0] == "king" and len(lines[1].split()) == 4
    back = WordVectors.load_word2vec(path)
    assert back.words == wv.words
    torch.testing.assert_close(back.raw, wv.raw, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="whitespace"):
        WordVectors(torch.zeros(1, 2), ["two words"]).save_word2vec(tmp_path / "bad.txt")


def test_byte_level_words_are_found_without_their_space_mark():
    wv = WordVectors(torch.eye(3), ["Ġking", "king", "Ġqueen"])
    assert wv.lookup("king") == 1 and wv.lookup("queen") == 2 and wv.lookup("Ġking") == 0


def test_from_ids_names_rows_by_the_tokenizer():
    tokenizer = word_tokenizer(["x", "y", "z"], ["<pad>", "<unk>"])
    table = torch.arange(10.0).view(5, 2)
    wv = WordVectors.from_ids(table, tokenizer, [2, 4])
    assert wv.words == ["x", "z"]
    torch.testing.assert_close(wv.raw, table[[2, 4]])


def test_model_vectors():
    torch.manual_seed(0)
    w2v = Word2Vec(10, 4)
    assert w2v.context.weight.abs().sum() == 0 and w2v.center.weight.abs().max() <= 0.5 / 4
    glove = GloVeModel(10, 4)
    torch.testing.assert_close(glove.vectors(), glove.word.weight + glove.context.weight)
    with pytest.raises(ValueError, match="must be >= 1"):
        Word2Vec(0, 4)


def test_reading_analogy_and_similarity_files(tmp_path):
    (tmp_path / "q.txt").write_text(
        ": capital-world\nathens greece baghdad iraq\n\nparis france rome italy\n"
    )
    assert read_analogies(tmp_path / "q.txt") == [
        ("athens", "greece", "baghdad", "iraq"),
        ("paris", "france", "rome", "italy"),
    ]
    (tmp_path / "bad.txt").write_text("a b c\n")
    with pytest.raises(ValueError, match="needs 4 words"):
        read_analogies(tmp_path / "bad.txt")
    (tmp_path / "sim.tsv").write_text("Word 1\tWord 2\tHuman (mean)\nlove\tsex\t6.77\ntiger\tcat\t7.35\n")
    assert read_similarity(tmp_path / "sim.tsv") == [("love", "sex", 6.77), ("tiger", "cat", 7.35)]
    (tmp_path / "empty.tsv").write_text("header only\n")
    with pytest.raises(ValueError, match="no 'word1 word2 score' lines"):
        read_similarity(tmp_path / "empty.tsv")
