"""Prefect flows: compositions of `tasks`, nothing else."""
