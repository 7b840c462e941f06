"""Loss as the context grows: next-token loss of a decoder on a text, by how many tokens of context it had.

The text (WikiText-2 test by default; articles as documents, each followed by EOS as ``pretrain prepare`` does) is
tokenized into one stream and cut into non-overlapping windows of ``context`` tokens. Within a window, the
prediction of token i + 1 has exactly i + 1 tokens of context; its loss is averaged over windows and reported by
buckets of context [1, 2), [2, 4), ..., [context / 2, context). A model that uses its long context keeps
lowering the loss in later buckets; a sliding-window decoder (window w, L layers) can flatten beyond L * w.

    python -m pretrain.evaluation.context_length CHECKPOINT --text FILE [--context 4096] [--batch-size 1]
                                                 [--max-windows N] [--attention sdpa|flex]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from pretrain.errors import InputError
from pretrain.models.transformer import Transformer

WIKITEXT2_TEST = "lm/wikitext-2/test.txt"
ARTICLE = "heading:= [^=].* ="


@torch.no_grad()
def position_losses(model: Transformer, tokens: Tensor, context: int, batch_size: int = 1) -> Tensor:
    """tokens (N,) -> (context - 1,): mean loss of predicting window token i + 1 from tokens 0..i."""
    n_windows = len(tokens) // context
    if n_windows == 0:
        raise InputError(f"the text has {len(tokens)} tokens, fewer than one window of --context {context}")
    windows = tokens[: n_windows * context].view(n_windows, context)
    total = torch.zeros(context - 1, dtype=torch.float64)
    model.eval()
    for batch in windows.split(batch_size):
        logits = model(batch).logits[:, :-1].float()  # (B, context - 1, V)
        loss = F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")  # (B, context - 1)
        total += loss.sum(0).double()
    return total / n_windows


def by_context(losses: Tensor) -> list[tuple[int, int, float]]:
    """(context - 1,) losses -> rows (from, to, mean loss) over contexts [2^j, 2^(j+1)) (context = index + 1)."""
    rows, start = [], 1
    while start <= len(losses):
        end = min(2 * start, len(losses) + 1)
        rows.append((start, end, losses[start - 1 : end - 1].mean().item()))
        start = end
    return rows


def text_tokens(text: str | Path, tokenizer: Any, eos: int, document: str = ARTICLE) -> Tensor:
    """(N,) ids of the raw text file ``text``: its documents (``document`` convention) each followed by EOS, as
    ``pretrain prepare`` writes them."""
    from pretrain.datamodules.corpus import Source, iter_documents
    from pretrain.datamodules.tokenizer import TextEncoder

    ids: list[int] = []
    encode = TextEncoder(tokenizer)  # as prepare encodes documents: special-token text stays text
    for doc in iter_documents([Source("text", str(text))], document=document):
        ids += encode.encode(doc) + [eos]
    return torch.tensor(ids)


def main(argv: list[str] | None = None) -> int:
    from pretrain.datamodules.tokenizer import resolve_eos
    from pretrain.evaluation.models import load_model_and_tokenizer

    parser = argparse.ArgumentParser(prog="python -m pretrain.evaluation.context_length", description=__doc__)
    parser.add_argument("checkpoint", help="a .ckpt, a run directory or a transformers directory")
    parser.add_argument("--text", required=True, help=f"raw text, e.g. <data root>/{WIKITEXT2_TEST}")
    parser.add_argument(
        "--document", default=ARTICLE, help="document convention of --text (pretrain.datamodules.corpus)"
    )
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--max-windows", type=int, default=None, help="evaluate only the first N windows")
    parser.add_argument("--attention", choices=("sdpa", "flex"), default=None, help="override the backend")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json when the checkpoint carries none")
    args = parser.parse_args(argv)
    try:
        if args.context < 2 or args.batch_size < 1:
            raise InputError(
                f"--context must be >= 2 and --batch-size >= 1, got {args.context}, {args.batch_size}"
            )
        if not Path(args.text).is_file():
            raise FileNotFoundError(f"--text {args.text} does not exist (pass the path of a raw text file)")
        model, tokenizer, specials = load_model_and_tokenizer(args.checkpoint, args.tokenizer)
        if model.config.arch != "decoder":
            raise InputError(
                f"{args.checkpoint} is an {model.config.arch} model; the loss by context needs a decoder"
            )
        if args.attention is not None:
            model.set_attention(args.attention)
        _, eos = resolve_eos(tokenizer, specials.get("eos_token"))  # each article ends in EOS, as in prepare
        tokens = text_tokens(args.text, tokenizer, eos, args.document)
        if args.max_windows is not None:
            tokens = tokens[: args.max_windows * args.context]
        losses = position_losses(model, tokens, args.context, args.batch_size)
    except (InputError, FileNotFoundError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    print(f"{args.checkpoint} on {args.text}: {len(tokens) // args.context} windows of {args.context} tokens")
    print("| context | loss | perplexity |\n|---|---|---|")
    for start, end, loss in by_context(losses):
        print(f"| {start}-{end - 1} | {loss:.3f} | {math.exp(loss):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
