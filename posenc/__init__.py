"""posenc: compare positional encodings in transformers, in and beyond the training length."""

__version__ = "0.1.0"
