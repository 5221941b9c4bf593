"""`parsed_once`: transformers' three parses of a GGUF file become one, and only inside the block."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from eagle3.verifier.gguf_once import parsed_once


def _tiny_gguf(path):
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_file_is_parsed_once_in_the_block_and_gguf_is_itself_again_after_it(tmp_path):
    path = _tiny_gguf(tmp_path / "tiny.gguf")
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    with parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(path) is first
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    with parsed_once():  # a later conversion reads the file again: it may have been replaced
        assert gguf.GGUFReader(path) is not first

    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
    fresh = gguf.GGUFReader(path)
    assert [t.name for t in first.tensors] == [t.name for t in fresh.tensors] == ["token_embd.weight"]
    np.testing.assert_array_equal(first.tensors[0].data, fresh.tensors[0].data)


def test_gguf_is_restored_when_the_conversion_fails(tmp_path):
    reader = gguf.GGUFReader
    with pytest.raises(FileNotFoundError), parsed_once():
        gguf.GGUFReader(tmp_path / "missing.gguf")
    assert gguf.GGUFReader is reader
