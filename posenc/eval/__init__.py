"""Evaluation metrics: BLEU/chrF for translation (:mod:`posenc.eval.bleu`) and length-resolved
perplexity for language modeling (:mod:`posenc.eval.lengths`).

Submodules are imported explicitly so that using one does not pull in the other's
dependencies (``sacrebleu`` for BLEU).
"""
