"""Measuring a draft: the verifier's baselines (plain greedy, n-gram), speculative decoding with
the draft, tau and its standard errors, a vLLM server's own counters, and the promotion decision."""
