"""Zero-shot evaluation as lm-evaluation-harness computes it: windows, the batched scorer, perplexity and bits per
byte of a text or a prepared .bin, LAMBADA, multiple choice, and the published figures to compare with."""
