"""The reference-equivalence checker: the only code outside tests that imports transformers."""
