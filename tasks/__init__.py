"""Prefect tasks: each wraps one `eagle3` step with its cache policy and its UI artifacts."""
