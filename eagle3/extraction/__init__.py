"""Hidden-state extraction: the verifier's aux-layer states for every sample, written as
content-addressed shards, by the verifier loaded in the step or by a vLLM server."""
