"""Decoding with the key/value cache: continuing a decoder-only LM's prompts (greedy,
sampling: :mod:`~posenc.decoding.lm`), and greedy and beam search for an
encoder-decoder (:mod:`~posenc.decoding.encdec`). Above the model, below evaluation
and the tasks."""
