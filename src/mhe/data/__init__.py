"""Data: corpora, benchmark readers, parallel text and tokenizers (no model code)."""
