"""Dequantize a GGUF verifier with transformers without parsing the file three times.

transformers reads a GGUF file's metadata once for the tokenizer, once for the config and once for
the weights (a `gguf.GGUFReader` each, nearly all of it the 49,152-token vocabulary and its merges
for SmolLM2-135M-Instruct), and builds gguf's tensor-name map once per module of the model (397
times). Both are pure functions of their arguments, and transformers looks both up on the `gguf`
module when it calls them, so within `parsed_once()` each is computed once. On two cores
SmolLM2-135M-Instruct then converts in 18.3 s instead of 40.1 (`python bench/gguf_convert.py`),
into the same bytes (which `tests/flows/test_default_smollm2.py` pins as well).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["parsed_once"]


@contextmanager
def parsed_once() -> Iterator[None]:
    """Memoize `gguf.GGUFReader` and `gguf.get_tensor_name_map` until the block ends (readers are
    read-only views of the file; the name map depends on the architecture and depth only)."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.cache(reader)  # type: ignore[misc,assignment]  # a cached factory in the class's place
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map  # type: ignore[misc]
