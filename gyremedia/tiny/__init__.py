"""Tiny random-weight replicas of each architecture, built offline from the same diffusers and transformers classes
as the real pipelines (as diffusers' own tests build theirs): what a backbone trains when ``pretrained`` is None,
what the tests and the quickstarts run, and what the real-size memory probes scale one layer of."""
