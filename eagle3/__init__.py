"""EAGLE-3 draft training pipeline: the library. Each step is one module with one entry function;
none of it imports Prefect (that lives in `tasks/` and `flows/`)."""
