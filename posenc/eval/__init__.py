"""Evaluation metrics for posenc (translation quality overall and per source-length bucket)."""

from posenc.eval.bleu import corpus_scores, scores_by_bucket, signature

__all__ = ["corpus_scores", "scores_by_bucket", "signature"]
