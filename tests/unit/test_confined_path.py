"""Files an RPC names are read only inside the service's directory (``common/confined_path.py``):
absolute names, ``..`` and symlinks out are refused before anything is opened."""

from __future__ import annotations

import os

import pytest

from rlharvest.common.confined_path import confined_path
from rlharvest.common.errors import FailedPrecondition, InvalidArgument


@pytest.fixture
def root(tmp_path):
    (tmp_path / "weights" / "v1").mkdir(parents=True)
    (tmp_path / "weights" / "v1" / "model.safetensors").write_bytes(b"x")
    (tmp_path / "secret").write_bytes(b"y")
    return tmp_path / "weights"


@pytest.mark.parametrize("name", ["v1/model.safetensors", "./v1/model.safetensors", "v1//model.safetensors"])
def test_a_name_inside_the_directory_resolves_there(root, name):
    assert confined_path(root, name) == (root / "v1" / "model.safetensors").resolve()


@pytest.mark.parametrize("name, says", [
    ("", "relative"),
    ("/etc/passwd", "absolute"),
    ("../secret", "'..'"),
    ("v1/../../secret", "'..'"),
    ("v1/..", "'..'"),
])
def test_empty_absolute_and_climbing_names_are_refused(root, name, says):
    with pytest.raises(InvalidArgument, match=says):
        confined_path(root, name)


def test_a_symlink_out_of_the_directory_is_refused_and_one_within_it_is_not(root):
    os.symlink(root.parent / "secret", root / "out.safetensors")
    os.symlink(root / "v1" / "model.safetensors", root / "in.safetensors")
    os.symlink(root.parent, root / "up")
    with pytest.raises(InvalidArgument, match="symlink"):
        confined_path(root, "out.safetensors")
    with pytest.raises(InvalidArgument, match="symlink"):
        confined_path(root, "up/secret")
    assert confined_path(root, "in.safetensors") == (root / "v1" / "model.safetensors").resolve()


def test_a_root_that_is_itself_a_symlink_still_confines(root, tmp_path):
    os.symlink(root, tmp_path / "link")
    assert confined_path(tmp_path / "link", "v1/model.safetensors").is_file()
    with pytest.raises(InvalidArgument):
        confined_path(tmp_path / "link", "../secret")


def test_without_a_directory_nothing_is_read(root):
    with pytest.raises(FailedPrecondition, match="weights_dir"):
        confined_path("", "v1/model.safetensors")


def test_a_name_the_filesystem_cannot_take_is_refused_not_raised(root):
    with pytest.raises(InvalidArgument):
        confined_path(root, "v1/model\x00.safetensors")
