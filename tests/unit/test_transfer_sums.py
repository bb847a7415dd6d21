"""Deltas verified in O(changes): linear sums, deltas encoded from known positions,
the checks a sparse decode makes before and after it writes, the trainer's chain of published
versions, and the agent's store serving a delta publish as it arrived."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlharvest.services.transfer_agent.checksum import (
    SUM_BLOCK,
    ChecksumMismatchError,
    linear_sum,
    linear_sum_change,
    linear_sum_change_torch,
    tensor_linear_sum,
)
from rlharvest.services.transfer_agent.delta_codec import (
    DeltaCodecError,
    Encoding,
    check_positions,
    decode,
    decode_with_torch,
    encode_changes,
    encode_changes_on_device,
    encode_delta,
    encoded_tensor,
    read_header,
    undo_delta,
)
from rlharvest.services.transfer_agent.delta_publish import (
    LastPublished,
    changed_index,
    changed_positions,
)
from rlharvest.services.transfer_agent.version_store import VersionStore

WIDTHS = ["u1", "<i2", "<i4", "<i8"]
MASK = (1 << 64) - 1


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(width),
                                              b.contiguous().view(width))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(WIDTHS), st.integers(1, 3 * SUM_BLOCK + 7), st.integers(0, 2**32 - 1),
       st.sampled_from([0.0, 0.001, 0.01, 0.3, 1.0]))
def test_a_change_moves_the_linear_sum_by_exactly_its_incremental_update(width, n, seed, density):
    rng = np.random.default_rng(seed)
    info = np.iinfo(np.dtype(width))
    old = rng.integers(info.min, info.max, n, endpoint=True, dtype=np.dtype(width))
    index = np.flatnonzero(rng.random(n) < density)
    new = old.copy()
    new[index] = rng.integers(info.min, info.max, index.size, endpoint=True,
                              dtype=np.dtype(width))
    update = linear_sum_change(index, old[index], new[index])
    assert (linear_sum(old) + update) & MASK == linear_sum(new)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(WIDTHS), st.integers(1, 3 * SUM_BLOCK + 7), st.integers(0, 2**32 - 1),
       st.sampled_from([0.0, 0.001, 0.3, 1.0]))
def test_the_torch_sum_change_equals_numpys_bit_for_bit(width, n, seed, density):
    """int64 arithmetic in torch wraps as uint64 does, so the accelerator's sum is the same."""
    rng = np.random.default_rng(seed)
    info = np.iinfo(np.dtype(width))
    index = np.flatnonzero(rng.random(n) < density)
    old, new = (rng.integers(info.min, info.max, index.size, endpoint=True,
                             dtype=np.dtype(width)) for _ in range(2))
    on_torch = linear_sum_change_torch(torch.from_numpy(index), torch.from_numpy(old),
                                       torch.from_numpy(new), n)
    assert on_torch == linear_sum_change(index, old, new)


@pytest.mark.parametrize("width", WIDTHS)
def test_any_single_element_change_changes_the_sum(width):
    rng = np.random.default_rng(7)
    n = 2 * SUM_BLOCK + 3
    old = rng.integers(0, 100, n).astype(width)
    base = linear_sum(old)
    for position in (0, 1, SUM_BLOCK - 1, SUM_BLOCK, n - 1):
        for flip in (1, 0x40, np.iinfo(np.dtype(width)).max):
            new = old.copy()
            new[position] ^= np.array(flip).astype(width)
            assert linear_sum(new) != base, (position, flip)


def test_swapping_two_elements_changes_the_sum():
    old = np.arange(SUM_BLOCK * 2, dtype="<i4")
    new = old.copy()
    new[[5, SUM_BLOCK + 5]] = new[[SUM_BLOCK + 5, 5]]  # same offset in two blocks
    assert linear_sum(new) != linear_sum(old)


def _pair(numel: int = 50_000, density: float = 0.01, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(numel, generator=gen).to(torch.bfloat16)
    new = old.clone()
    where = torch.rand(numel, generator=gen) < density
    new[where] = torch.randn(numel, generator=gen).to(torch.bfloat16)[where]
    return old, new


@pytest.mark.parametrize("encoding", [Encoding.COO, Encoding.BITMAP])
def test_encoding_from_known_positions_equals_diffing_and_decodes_bit_exact(encoding):
    old, new = _pair()
    index = changed_positions(old, new)
    from_positions = encode_changes(old, new, index, encoding=encoding)
    diffed = encode_delta(old, new, encoding=encoding)
    assert from_positions.payload == diffed.payload
    assert from_positions.target_sum == tensor_linear_sum(new)
    assert from_positions.base_sum == tensor_linear_sum(old)
    assert same_bits(decode(from_positions, old, base_sum=tensor_linear_sum(old)), new)


@pytest.mark.parametrize(("density", "encoding"), [(0.01, Encoding.COO),
                                                   (0.3, Encoding.BITMAP),
                                                   (1.0, Encoding.DENSE)])
def test_the_device_encoder_writes_the_host_encoders_payload_byte_for_byte(density, encoding):
    """``encode_changes_on_device`` is device-agnostic torch: run here on CPU tensors, it must
    give exactly what the numpy encoder gives (the GPU run is in the CUDA test below)."""
    old, new = _pair(density=density)
    index = changed_index(old, new)
    on_device = encode_changes_on_device(old, new, index)
    on_host = encode_changes(old, new, index.numpy())
    assert on_device.encoding == encoding
    if encoding == Encoding.DENSE:  # with the sum, from the one host copy of its bits
        assert on_device.target_sum == tensor_linear_sum(new)
        on_host = replace(on_host, target_sum=on_device.target_sum)
    assert on_device == on_host
    with pytest.raises(DeltaCodecError, match="strictly increasing"):
        check_positions(index.flip(0), new.numel())
    with pytest.raises(DeltaCodecError, match="strictly increasing"):
        encode_changes_on_device(old, new, index.flip(0))
    with pytest.raises(DeltaCodecError, match="strictly increasing"):
        encode_changes_on_device(old, new, torch.tensor([new.numel()]))
    with pytest.raises(DeltaCodecError, match="strictly increasing"):
        LastPublished(1, {"x": old}).encode_next({"x": new}, {"x": index.flip(0)})


@pytest.mark.parametrize("encoding", [Encoding.COO, Encoding.BITMAP])
def test_the_torch_decoder_applies_what_the_numpy_decoder_applies(encoding):
    """``decode_with_torch`` (what a base on a GPU decodes through) on CPU tensors: the same
    bits as ``decode``, in place and into a copy, and undone by ``undo_delta``."""
    old, new = _pair(density=0.02)
    encoded = encode_delta(old, new, encoding=encoding)
    base_sum = tensor_linear_sum(old)
    copied = decode_with_torch(encoded, old, base_sum=base_sum)
    assert same_bits(copied, decode(encoded, old, base_sum=base_sum)) and same_bits(copied, new)
    held = old.clone()
    applied = decode_with_torch(encoded.payload, held, inplace=True)
    assert applied.data_ptr() == held.data_ptr() and same_bits(held, new)  # written into held
    undo_delta(encoded, held)
    assert same_bits(held, old)


def test_the_torch_decoder_checks_everything_before_it_writes():
    old, new = _pair()
    encoded = encode_delta(old, new, encoding=Encoding.COO)
    held = old.clone()
    with pytest.raises(ChecksumMismatchError, match="not the one it was encoded against"):
        decode_with_torch(encoded, held, inplace=True, base_sum=tensor_linear_sum(old) ^ 1)
    damaged = bytearray(encoded.payload)
    damaged[-1] ^= 0x04  # the last changed value
    with pytest.raises(ChecksumMismatchError, match="do not lead from the base's sum"):
        decode_with_torch(bytes(damaged), held, inplace=True, base_sum=tensor_linear_sum(old))
    header = read_header(encoded.payload)
    at = header.body_offset + 4  # the first two in-block offsets of the only block
    repeated = bytearray(encoded.payload)
    repeated[at + 2:at + 4] = repeated[at:at + 2]
    with pytest.raises(DeltaCodecError, match="corrupt"):
        decode_with_torch(bytes(repeated), held, inplace=True)
    with pytest.raises(DeltaCodecError, match="sparse deltas"):
        decode_with_torch(encode_delta(old, new, encoding=Encoding.DENSE), held)
    assert same_bits(held, old)


def test_positions_that_did_not_change_cost_bytes_only_and_bad_positions_are_refused():
    old, new = _pair()
    index = changed_positions(old, new)
    padded = np.union1d(index, np.arange(0, 50_000, 997))  # some unchanged positions too
    encoded = encode_changes(old, new, padded, encoding=Encoding.COO)
    assert encoded.count == padded.size > index.size
    assert same_bits(decode(encoded, old), new)
    for bad in (index[::-1], np.append(index, index[-1]), np.array([50_000]), np.array([-1])):
        with pytest.raises(DeltaCodecError, match="strictly increasing"):
            encode_changes(old, new, bad)


def test_a_wrong_recorded_base_sum_is_refused_before_anything_is_written():
    old, new = _pair()
    encoded = encode_delta(old, new)
    held = old.clone()
    with pytest.raises(ChecksumMismatchError, match="not the one it was encoded against"):
        decode(encoded, held, inplace=True, base_sum=tensor_linear_sum(old) ^ 1)
    assert same_bits(held, old)


def test_damaged_delta_values_are_caught_by_the_sums_and_the_base_is_restored():
    old, new = _pair()
    encoded = encode_delta(old, new, encoding=Encoding.COO)
    damaged = bytearray(encoded.payload)
    damaged[-1] ^= 0x04  # the last changed value
    held = old.clone()
    with pytest.raises(ChecksumMismatchError, match="do not lead from the base's sum"):
        decode(bytes(damaged), held, inplace=True, base_sum=tensor_linear_sum(old))
    assert same_bits(held, old)


def test_repeated_coo_positions_are_refused_as_corrupt():
    old, new = _pair(numel=1000, density=0.05)
    encoded = encode_delta(old, new, encoding=Encoding.COO)
    header = read_header(encoded.payload)
    blocks = 1
    at = header.body_offset + 4 * blocks  # the first two in-block offsets
    damaged = bytearray(encoded.payload)
    damaged[at + 2:at + 4] = damaged[at:at + 2]
    with pytest.raises(DeltaCodecError, match="strictly increasing"):
        decode(bytes(damaged), old.clone())


def test_damage_at_an_untouched_position_needs_a_full_audit_to_be_seen():
    """The price of O(changes) verification, as the codec documents it: a held tensor damaged
    where no delta writes passes a delta pull; re-reading it (the audit) finds it."""
    old, new = _pair()
    recorded = tensor_linear_sum(old)
    encoded = encode_delta(old, new, base_sum=recorded)
    untouched = int(np.setdiff1d(np.arange(50_000), changed_positions(old, new))[0])
    held = old.clone()
    held.view(torch.int16)[untouched] ^= 1
    decode(encoded, held, inplace=True, base_sum=recorded)  # passes: nothing re-read
    assert tensor_linear_sum(held) != encoded.target_sum  # the audit sees it


def test_the_trainer_chains_versions_and_every_delta_verifies_against_the_last():
    tensors = {"a": _pair(seed=1)[0], "b": _pair(numel=3000, seed=2)[0]}
    last = LastPublished(1, tensors)
    held = {n: t.clone() for n, t in tensors.items()}
    sums: dict[str, int] = {}
    for version in range(2, 6):
        nxt = {"a": _pair(seed=version)[1] if version == 4 else tensors["a"].clone(),
               "b": tensors["b"].clone()}
        nxt["b"].view(torch.int16)[version::97] ^= 3
        encoded, stats = last.encode_next(nxt)
        assert stats.numel == 53_000 and stats.changed == sum(
            changed_positions(tensors[n], nxt[n]).size for n in nxt)
        for name, item in encoded.items():
            decode(encoded_tensor(item.payload), held[name], inplace=True,
                   base_sum=sums.get(name))
            sums[name] = item.target_sum
            assert same_bits(held[name], nxt[name])
        assert sums == {n: tensor_linear_sum(t) for n, t in nxt.items()}
        last, tensors = LastPublished.after(version, nxt, encoded), nxt
    new_name = last.encode_next({**tensors, "c": torch.ones(4)})[0]["c"]
    assert new_name.encoding == Encoding.DENSE


def test_advancing_the_record_in_place_equals_copying_the_published_version():
    """``advance`` applies the sparse deltas to the trainer's held copy (no copy of the model
    per publish); the record then encodes the next version exactly as a fresh copy does, and a
    tensor that went dense, one new and one gone are handled too."""
    tensors = {"a": _pair(seed=1)[0], "b": _pair(numel=3000, seed=2)[0], "gone": torch.ones(3)}
    moved, copied = LastPublished(1, tensors), LastPublished(1, tensors)
    held_a = moved.tensors["a"]
    for version in range(2, 5):
        dense = torch.randn(3000, generator=torch.Generator().manual_seed(100 + version))
        nxt = {"a": tensors["a"].clone(), "b": dense.to(tensors["b"].dtype)}  # b: all changed
        nxt["a"].view(torch.int16)[version::1000] ^= 5  # 0.1%: applied
        if version == 3:
            nxt["new"] = torch.arange(6.0)
        encoded, _ = moved.encode_next(nxt)
        assert encoded == copied.encode_next(nxt)[0]
        assert encoded["a"].needs_base and not encoded["b"].needs_base
        moved = moved.advance(version, nxt, encoded)
        copied = LastPublished.after(version, nxt, encoded)
        assert moved.version == copied.version == version
        assert set(moved.tensors) == set(nxt) and moved.sums == copied.sums
        assert all(same_bits(moved.tensors[n], t) for n, t in nxt.items())
        tensors = nxt
    assert moved.tensors["a"] is held_a  # applied where it was held: never copied
    denser = {**tensors, "a": tensors["a"].clone()}
    denser["a"].view(torch.int16)[::50] ^= 5  # 2% changed: a copy is cheaper than applying
    encoded, _ = moved.encode_next(denser)
    assert encoded["a"].needs_base
    assert moved.advance(5, denser, encoded).tensors["a"] is not held_a
    assert same_bits(moved.tensors["a"], denser["a"])


CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: weights "
                               "held on the accelerator (run on a GPU node by "
                               "tools/gpu_fastpaths.sh)")


@CUDA_ONLY
def test_a_delta_against_a_base_on_cuda_is_applied_there_and_checked_first():
    old, new = _pair(numel=3 * SUM_BLOCK + 7, density=0.02)  # several blocks, a partial one
    for encoding in (Encoding.COO, Encoding.BITMAP):
        encoded = encode_delta(old, new, encoding=encoding)
        held = old.cuda()
        out = decode(encoded, held, inplace=True, base_sum=tensor_linear_sum(old))
        assert out.is_cuda and out.data_ptr() == held.data_ptr()
        assert same_bits(held.cpu(), new)
        undo_delta(encoded, held)
        assert same_bits(held.cpu(), old)
    damaged = bytearray(encode_delta(old, new).payload)
    damaged[-1] ^= 0x04
    with pytest.raises(ChecksumMismatchError, match="do not lead from the base's sum"):
        decode(bytes(damaged), held, inplace=True, base_sum=tensor_linear_sum(old))
    assert same_bits(held.cpu(), old)


@CUDA_ONLY
def test_a_record_held_on_cuda_encodes_what_a_host_record_encodes():
    tensors = {"a": _pair(numel=3 * SUM_BLOCK + 7, seed=1)[0], "b": _pair(numel=3000, seed=2)[0]}
    on_gpu = LastPublished(1, {n: t.cuda() for n, t in tensors.items()})
    on_cpu = LastPublished(1, tensors)
    for version in range(2, 5):
        nxt = {n: t.clone() for n, t in tensors.items()}
        nxt["a"].view(torch.int16)[version::100] ^= 3
        nxt["b"].view(torch.int16)[::3] ^= 1  # a third changed: bitmap
        positions = {"a": changed_positions(tensors["a"], nxt["a"])}
        encoded, stats = on_gpu.encode_next({n: t.cuda() for n, t in nxt.items()},
                                            {"a": torch.from_numpy(positions["a"]).cuda()})
        expected, expected_stats = on_cpu.encode_next(nxt, positions)
        assert encoded == expected and stats == expected_stats
        on_gpu = on_gpu.advance(version, {n: t.cuda() for n, t in nxt.items()}, encoded)
        on_cpu = on_cpu.advance(version, nxt, expected)
        assert all(t.is_cuda for t in on_gpu.tensors.values())
        assert on_gpu.sums == on_cpu.sums
        tensors = nxt


def test_the_store_serves_a_delta_publish_as_published_and_learns_its_sums():
    old, new = _pair()
    store = VersionStore(byte_budget=1 << 24)
    store.publish(1, {"w": old}, now=0.0)
    encoded = encode_delta(old, new)
    store.publish(2, {"w": new}, now=1.0, deltas=(1, {"w": encoded}))
    plan = store.plan(2, holding=1)
    assert plan.tensors == (("w", encoded),)  # the very encoding: nothing re-encoded
    assert store.sums(1) == {"w": tensor_linear_sum(old)}
    assert store.sums(2) == {"w": tensor_linear_sum(new)}
    dense = store.plan(2)
    assert dense.tensors[0][1].target_sum == tensor_linear_sum(new)  # handed on to workers
    store.publish(3, {"w": new.clone()}, now=2.0)  # evicts 1 (two versions kept)
    assert store.sums(1) == {}
