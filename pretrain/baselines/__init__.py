"""The baselines the transformer replaced, on the same tokenizer, prepared corpora, Trainer, loggers and metrics.

    pretrain baseline recipes/sgns-tiny.yaml [key=value ...] [--print-config]

A baseline recipe composes like a pretraining recipe (``pretrain.config.compose``) and shares its sections
(tokenizer, data, objective, optim, trainer, strategy, logger, checkpoint; ``model`` is unused). Its own section
``baselines`` (pieces in ``configs/baselines/``) names the ``kind`` and holds its options:

    sgns     skip-gram / CBOW (``pretrain.objectives.sgns``) on the prepared corpus through ``PretrainDataModule``
    glove    GloVe (``pretrain.objectives.glove``) on the co-occurrence matrix of the prepared train split
    rnn_lm   LSTM/GRU language model (``pretrain.models.rnn``) trained with the ``clm`` objective by truncated BPTT:
             the train stream is cut into B parallel streams and batch i+1 continues batch i row by row, the
             hidden state carried (detached) between batches and reset every epoch and every validation
    seq2seq  RNN encoder-decoder with attention on line-aligned parallel text (``task: parallel``, e.g.
             Multi30k) or a toy task (``reverse``, ``copy``); greedy or beam decoding, BLEU (sacrebleu), exact
             match, attention heatmaps

Modules: ``config`` (the section's schema, ``load_config``), ``data`` (tokenizer and prepared corpora),
``module`` (the shared LightningModule and fit), one module per family (``word_vectors``, ``lstm_lm``,
``seq2seq`` with ``heatmaps``), ``run`` (``run_recipe``) and ``cli`` (arguments only).

A missing tokenizer is trained and missing prepared corpora are written first (as ``pretrain tokenizer`` and
``pretrain prepare`` do). Runs use one device and resume like ``pretrain fit`` (``resume=auto``: the run's newest
checkpoint; ``resume=null``: fresh). Outputs under ``run_dir``: Lightning
checkpoints and logs, ``results.json``; word vectors also ``vectors.txt`` (word2vec text format), seq2seq
also ``alignments/*.png``.
"""
