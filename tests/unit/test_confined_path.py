"""Files an RPC names are read only inside the service's directory (``rlharvest/common/confined_path.py``):
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


@pytest.mark.parametrize("name, says", [
    ("a/" * 100_000 + "x", "over the 4096 a path may have"),  # 200 KB of short components
    ("v1/" + "y" * 256, "component of 256 bytes"),
    ("v1/model\0.safetensors", "NUL byte"),
])
def test_names_beyond_the_os_limits_are_refused_before_any_filesystem_call(tmp_path, name, says):
    # the root does not even exist: nothing was resolved or opened to refuse them
    with pytest.raises(InvalidArgument, match=says) as refused:
        confined_path(tmp_path / "absent", name)
    assert len(str(refused.value)) < 200  # the refusal quotes a short prefix, not the name


def test_the_longest_names_the_os_allows_still_resolve(root):
    name = "./" * 1000 + "v1/model.safetensors"  # 2,020 bytes, 1,002 components
    assert confined_path(root, name) == (root / "v1" / "model.safetensors").resolve()


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


class _Aborted(Exception):
    pass


class _Context:
    """What ``errors.abort`` needs of a gRPC servicer context."""

    async def abort(self, code, details):
        raise _Aborted(code, details)


def _weights(seed: int) -> dict:
    from rlharvest.models.tiny_model import build_model

    return {k: v.contiguous() for k, v in build_model("tiny", seed=seed).state_dict().items()
            if k != "lm_head.weight"}


async def test_a_directory_swapped_for_a_symlink_out_after_load_weights_checked_it_is_not_read_through(
        root, tmp_path):
    """LoadWeights checks the name when it is called and loads between engine steps, later: a
    directory of the path swapped meanwhile for a symlink out of weights_dir must not make the
    load read the file outside (here a weights file of other values); the file checked is the
    file read."""
    import asyncio

    import torch
    from safetensors.torch import save_file

    from rlharvest.common.pb import rollout_worker_pb2 as pb
    from rlharvest.services.rollout_worker.service import WorkerService
    from rlharvest.services.rollout_worker.torch_engine import TorchEngine

    inside, outside = _weights(1), _weights(2)
    save_file(inside, str(root / "v1" / "model.safetensors"))
    (tmp_path / "elsewhere").mkdir()
    save_file(outside, str(tmp_path / "elsewhere" / "model.safetensors"))
    engine = TorchEngine("tiny", seed=0, max_running=4, max_len=128)
    service = WorkerService(engine, "w-0", "127.0.0.1:1", "tiny", kind=0, capacity=4,
                            max_len=128, weights_dir=str(root))
    load = asyncio.create_task(service.LoadWeights(
        pb.LoadWeightsRequest(path="v1/model.safetensors", version=1), _Context()))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not load.done()  # checked, and waiting for a step boundary: the pump is not running
    os.rename(root / "v1", root / "v1-checked")
    os.symlink(tmp_path / "elsewhere", root / "v1")
    pump = asyncio.create_task(service.run_engine())
    try:
        try:
            reply = await asyncio.wait_for(load, 30)
        except _Aborted:
            reply = None  # refusing is fine too; reading the outside file is not
        weights = engine.weights()
        assert not torch.equal(weights["model.embed_tokens.weight"],
                               outside["model.embed_tokens.weight"]), "read through the symlink"
        if reply is not None:
            assert reply.weight_version == 1
            assert torch.equal(weights["model.embed_tokens.weight"],
                               inside["model.embed_tokens.weight"])
    finally:
        pump.cancel()
        await asyncio.gather(pump, return_exceptions=True)
        service.pump.close()


def test_a_directory_swapped_for_a_symlink_out_between_the_check_and_the_open_is_refused(
        root, monkeypatch):
    """The swap lands in open_confined's own gap (after its check, before its open): the path
    of the file the kernel opened is outside, so it is refused and nothing is returned."""
    from rlharvest.common import confined_path as module

    checked = module.confined_path

    def check_then_swap(*args, **kwargs):
        path = checked(*args, **kwargs)
        os.rename(root / "v1", root / "v1-checked")
        os.symlink(root.parent, root / "v1")  # v1/secret now leads to the file outside
        return path  # checked: inside, as a name, until the swap

    (root / "v1" / "secret").write_bytes(b"inside")
    monkeypatch.setattr(module, "confined_path", check_then_swap)
    with pytest.raises(InvalidArgument, match="outside the service's directory"):
        module.open_confined(root, "v1/secret")


def test_open_confined_reads_a_file_inside_through_a_link_that_stays_inside(root):
    from rlharvest.common.confined_path import descriptor_path, open_confined

    os.symlink(root / "v1", root / "current")
    with open_confined(root, "current/model.safetensors") as file:
        assert file.read() == b"x"
        with open(descriptor_path(file), "rb") as again:  # the open file itself, by path
            assert again.read() == b"x"
    os.symlink(root.parent, root / "up")
    with pytest.raises(InvalidArgument, match="symlink"):
        open_confined(root, "up/secret")


def test_open_confined_refuses_a_missing_name_a_directory_and_a_fifo_without_blocking(root):
    from rlharvest.common.confined_path import open_confined
    from rlharvest.common.errors import NotFound

    os.mkfifo(root / "pipe")  # a writer never comes: a blocking open would hang here
    for name in ("absent", "v1", "pipe"):
        with pytest.raises(NotFound):
            open_confined(root, name)
