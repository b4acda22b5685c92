"""open_gguf's reader builds the same metadata fields as gguf's own, and refuses a cut array."""

from __future__ import annotations

import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from edgedecode.model.gguf_file import ModelFileError, field_array, field_value, open_gguf

STRINGS = ["<pad>", "", "▁the", "é‘漢字", "\n", "a" * 300]


def _write(path) -> None:
    """A tensor-less GGUF whose metadata holds every kind of array the fast path cuts, and others."""
    writer = GGUFWriter(str(path), "llama")
    writer.add_array("test.strings", STRINGS)
    writer.add_array("test.floats", [0.5, -1.25, 3.0e9])
    writer.add_key_value("test.int32s", [1, -2, 3], GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
    writer.add_key_value("test.bytes", [0, 255, 7], GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT8)
    writer.add_array("test.bools", [True, False, True])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_string("test.scalar_string", "hello")
    writer.add_uint32("test.scalar", 7)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_fields_equal_gguf_readers_part_for_part(tmp_path):
    path = tmp_path / "meta.gguf"
    _write(path)
    ours, theirs = open_gguf(path), GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.data, mine.types) == (field.offset, field.data, field.types), name
        assert [(p.dtype, p.shape, p.tolist()) for p in mine.parts] == [
            (p.dtype, p.shape, p.tolist()) for p in field.parts
        ], name
    assert ours.data_offset == theirs.data_offset
    assert field_value(ours, "test.strings") == STRINGS
    assert field_array(ours, "test.floats").tolist() == [0.5, -1.25, 3.0e9]
    assert field_value(ours, "test.bools") == [True, False, True]


def test_an_array_cut_by_the_end_of_the_file_is_a_model_file_error(tmp_path):
    path = tmp_path / "meta.gguf"
    _write(path)
    whole = path.read_bytes()
    cut = whole.index(b"a" * 300) + 100  # inside the last string of test.strings
    path.write_bytes(whole[:cut])
    with pytest.raises(ModelFileError, match="truncated or corrupt"):
        open_gguf(path)
