"""The verifier: resolved once into a local HF directory, loaded for text, its hidden states
captured by hooks, and its decoding passes on fixed KV buffers (CUDA graphs on a GPU)."""
