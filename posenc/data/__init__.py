"""Data for posenc: downloads, sources (text and parallel corpora), tokenizers, the LM and
translation data modules, generated algorithmic problems and passkey instances."""
