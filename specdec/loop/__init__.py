"""The draft -> verify -> accept loop built on specdec's ops: a model runner (models/), drafters (drafters/),
the adaptive speculation policy (adaptive.py), `SpeculativeDecoder.generate` (decoding.py), its CLI (cli.py),
and the shipped byte-level model pair (assets/).

The op library (specdec/*.py, specdec/integrations, specdec.kernels) never imports this package: an engine
that calls the ops loads none of it."""
