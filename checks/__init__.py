"""The reference-equivalence checker, installed as `gpt2_port_checks` (the directory stays `checks/` in the checkout).

It imports the library and transformers, never the CLI. Two layers, imports pointing down:

    base  metrics.py (error figures, next-token agreement), tolerances.py (named gates), noise.py (the noise-floor
          verdict), prompts.py (default inputs as token ids), reference.py (transformers' model and its hooks),
          points.py (the comparison points and capturing them from both models), results.py (PointResult, Report,
          Sweep: the data every output is made from)
    top   forward.py (the forward-parity runner: one configuration or a sweep), render.py (the one table
          renderer: terminal, plain, Markdown), plots.py (PNG of error per layer), attention_maps.py (heatmaps)
"""
