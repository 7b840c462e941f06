"""Document conventions (``pretrain.datamodules.corpus``): set per source in a recipe, read the same way by ``prepare`` and
by evaluation's perplexity on a text file."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from training_utils import tiny_recipe

from pretrain.cli import main
from pretrain.datamodules.corpus import document_mode, iter_documents, resolve_sources
from pretrain.datamodules.prepare import read_meta
from pretrain.evaluation.tasks import load_documents

SEP = "<|endoftext|>"
line = st.text(st.characters(whitelist_categories=("Ll", "Nd"), whitelist_characters=" "), min_size=1).filter(
    lambda s: s.strip()
)
# a document: paragraphs of lines, separated by one blank line (a paragraph break inside the document)
document = st.lists(st.lists(line, min_size=1, max_size=3), min_size=1, max_size=3).map(
    lambda paragraphs: "\n\n".join("\n".join(p) for p in paragraphs)
)


@settings(max_examples=60, deadline=None)
@given(st.lists(document, min_size=1, max_size=5))
def test_separator_documents_keep_their_paragraph_breaks(tmp_path_factory, documents):
    path = tmp_path_factory.mktemp("sep") / "c.txt"
    path.write_text(f"\n{SEP}\n".join(documents) + "\n")
    read = list(iter_documents(resolve_sources(path), document=f"separator:{SEP}"))
    assert read == documents
    blank = list(iter_documents(resolve_sources(path), document="blank_line"))
    assert all("\n\n" not in d for d in blank)  # the default convention drops every paragraph break


@settings(max_examples=60, deadline=None)
@given(st.lists(document, min_size=1, max_size=5))
def test_heading_documents_start_at_their_heading(tmp_path_factory, documents):
    """WikiText style: every document starts with a top-level '= Title =' line; '= = Section = =' lines do not
    start one."""
    articles = [f" = Title {i} = \n\n = = Part = = \n{d}" for i, d in enumerate(documents)]
    path = tmp_path_factory.mktemp("heading") / "c.txt"
    path.write_text("\n".join(articles) + "\n")
    read = list(iter_documents(resolve_sources(path), document="heading:= [^=].* ="))
    assert read == [a.rstrip("\n") for a in articles]


def test_document_mode_names_the_conventions():
    assert document_mode("separator: <doc> ") == ("separator", "<doc>")
    assert document_mode("heading:= [^=].* =") == ("heading", "= [^=].* =")
    assert document_mode("file") == ("file", None)
    for bad in ("para", "separator:", "separator", "heading:"):
        with pytest.raises(ValueError, match="file, line, blank_line, separator:S .* or heading:R"):
            document_mode(bad)
    with pytest.raises(ValueError, match="not a regular expression"):
        document_mode("heading:= (")


def test_recipe_sets_the_convention_and_evaluation_reads_it_alike(tmp_path, capsys, tiny_world):
    """``data.sources[].document`` reaches ``pretrain prepare``; ``load_documents`` with the same convention
    yields exactly the documents prepare wrote."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("A b.\n\nC d.\n===\nE f.\n\n\nG h.\n===\nI j.\n")
    source = {
        "name": "c",
        "text": [str(corpus)],
        "prepared": str(tmp_path / "p"),
        "document": "separator:===",
    }
    recipe = tiny_recipe(tmp_path, tiny_world, "gpt", data={"sources": [source], "val_fraction": 0.0})
    assert main(["prepare", str(recipe)]) == 0
    meta = read_meta(tmp_path / "p")
    assert meta["settings"]["document"] == "separator:===" and meta["documents"] == 3
    assert load_documents(corpus, "separator:===") == ["A b.\n\nC d.", "E f.\n\n\nG h.", "I j."]
    assert load_documents(corpus, "blank_line") == [
        "A b.",
        "C d.\n===\nE f.",
        "G h.\n===\nI j.",
    ]  # paragraphs
    assert load_documents(corpus) == [corpus.read_text()]  # evaluation's default: the file, verbatim
    capsys.readouterr()
    assert main(["prepare", str(recipe), "data.sources.0.document=para"]) == 2
    assert "data.sources[0].document='para'" in capsys.readouterr().err
