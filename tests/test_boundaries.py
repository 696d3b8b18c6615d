"""Package boundaries: the data-file naming rule is one rule for the worker that writes the files
and the trainer side that commits, cleans up and inspects them."""

from __future__ import annotations

from asyncckpt.formats import SAFETENSORS, TORCH_SAVE, data_file_name, is_data_file, new_file_tag


def test_every_data_file_name_is_recognised_with_its_tag():
    tag = new_file_tag()
    assert tag != new_file_tag()  # a fresh tag per re-save
    for fmt in (TORCH_SAVE, SAFETENSORS):
        for file_tag in ("", tag):
            name = data_file_name(3, 12, fmt, file_tag)
            assert is_data_file(name)
            assert is_data_file(name, tag=file_tag)
            assert not is_data_file(name, tag=new_file_tag())
    assert not is_data_file(data_file_name(0, 0), tag=tag)  # an untagged file is not the re-save's
    for foreign in ("model.safetensors", "__0_0.distcp.bak", "__0_0.tmp.distcp", ".metadata", "__0.metadata"):
        assert not is_data_file(foreign), foreign

