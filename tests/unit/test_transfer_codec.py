"""ROSE §4.2 sparsity-aware transfer: lossless deltas, the smaller encoding, checked arrival."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlharvest.services.transfer_agent.checksum import (
    ChecksumMismatchError,
    tensor_checksum,
    verify_checksum,
)
from rlharvest.services.transfer_agent.delta_codec import (
    COO_BLOCK,
    DeltaCodecError,
    Encoding,
    body_sizes,
    choose_encoding,
    decode,
    dense_break_even,
    encode_delta,
    encode_dense,
    read_header,
)

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
SPECIALS = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-40, -1e-40, 65504.0]
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BITS.get(t.dtype, t.dtype))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


@st.composite
def version_pairs(draw, max_numel: int = 3000):
    """(old, new) with a random shape, dtype, changed fraction, and special values on both."""
    dtype = draw(st.sampled_from(FLOATS))
    shape = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)))
    while math.prod(shape) > max_numel:
        shape = shape[1:] or (1,)
    seed = draw(st.integers(0, 2**31 - 1))
    density = draw(st.sampled_from([0.0, 0.001, 0.01, 0.05, 0.2, 0.6, 1.0]))
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(shape, generator=gen).to(dtype)
    new = old.clone()
    changed = torch.rand(shape, generator=gen) < density
    new[changed] = torch.randn(shape, generator=gen).to(dtype)[changed]
    for t in (old, new):  # sprinkle NaN/inf/-0.0/subnormals on both sides
        flat = t.view(-1)
        where = torch.randint(0, flat.numel(), (draw(st.integers(0, 4)),), generator=gen)
        flat[where] = torch.tensor(draw(st.sampled_from(SPECIALS))).to(dtype)
    return old, new


@settings(max_examples=150, deadline=None)
@given(version_pairs())
def test_delta_reconstructs_new_version_bit_exactly(pair):
    old, new = pair
    encoded = encode_delta(old, new)
    assert same_bits(decode(encoded, old), new)
    assert same_bits(decode(encoded.payload, old.clone(), inplace=True), new)


@settings(max_examples=60, deadline=None)
@given(version_pairs(), st.sampled_from([Encoding.COO, Encoding.BITMAP]))
def test_coo_and_bitmap_both_reconstruct_exactly(pair, encoding):
    old, new = pair
    encoded = encode_delta(old, new, encoding=encoding)
    assert encoded.encoding == encoding
    assert same_bits(decode(encoded, old), new)


def test_negative_zero_nan_payload_and_inf_survive_a_delta():
    old = torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=torch.float32)
    new = old.clone()
    new_bits = new.view(torch.int32)
    new_bits[0] = -(2**31)  # -0.0: equal to 0.0 as a float, different bits
    new_bits[1] = 0x7FC00123  # a NaN with a payload
    new[2] = float("-inf")
    encoded = encode_delta(old, new)
    assert encoded.count == 3
    assert same_bits(decode(encoded, old), new)


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(FLOATS), st.integers(1, 300_000), st.floats(0.0, 1.0))
def test_encoding_is_the_smallest_and_dense_only_above_break_even(dtype, numel, density):
    itemsize = torch.empty((), dtype=dtype).element_size()
    changed = round(numel * density)
    sizes = body_sizes(numel, changed, itemsize)
    chosen = choose_encoding(numel, changed, itemsize)
    assert sizes[chosen] == min(sizes.values())
    assert (chosen == Encoding.DENSE) == (changed >= dense_break_even(dtype, numel) * numel)


def test_dense_fallback_is_chosen_just_above_break_even_and_not_below():
    old = torch.zeros(64 * 1024, dtype=torch.bfloat16)
    threshold = math.ceil(dense_break_even(torch.bfloat16, old.numel()) * old.numel())
    for changed, dense in ((threshold - 1, False), (threshold, True)):
        new = old.clone()
        new[:changed] = 1.0
        encoded = encode_delta(old, new)
        assert (encoded.encoding == Encoding.DENSE) == dense
        assert same_bits(decode(encoded, old), new)


def test_encoded_size_matches_the_size_the_choice_was_made_on():
    old = torch.randn(3 * COO_BLOCK + 17).to(torch.bfloat16)
    for density in (0.001, 0.1, 0.99):
        new = old.clone()
        mask = torch.rand(old.shape) < density
        new[mask] += 1
        encoded = encode_delta(old, new)
        header = read_header(encoded.payload)
        body = body_sizes(old.numel(), encoded.count, 2)[encoded.encoding]
        assert encoded.nbytes == header.body_offset + body


def test_sparse_delta_at_99_percent_zeros_is_at_most_3_percent_of_dense():
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(1 << 20, generator=gen).to(torch.bfloat16)
    new = old.clone()
    new[torch.randperm(old.numel(), generator=gen)[: old.numel() // 100]] += 1
    assert encode_delta(old, new).nbytes <= 0.03 * encode_dense(new).nbytes


def test_dense_encoding_decodes_without_base_and_delta_demands_one():
    old, new = torch.zeros(100), torch.zeros(100)
    new[3] = 1
    assert same_bits(decode(encode_dense(new)), new)
    with pytest.raises(DeltaCodecError, match="needs the base version"):
        decode(encode_delta(old, new))


def test_delta_against_the_wrong_base_is_caught_by_checksum_and_base_restored():
    gen = torch.Generator().manual_seed(1)
    old = torch.randn(5000, generator=gen)
    new = old.clone()
    new[::97] += 1
    wrong_base = old.clone()
    wrong_base[10] += 0.5
    kept = wrong_base.clone()
    with pytest.raises(ChecksumMismatchError, match="pull this tensor again"):
        decode(encode_delta(old, new), wrong_base, inplace=True)
    assert same_bits(wrong_base, kept)  # the failed apply was undone


def test_a_damaged_dense_payload_decoded_in_place_leaves_its_base_unchanged():
    base = torch.zeros(16)
    damaged = bytearray(encode_dense(torch.arange(16, dtype=torch.float32)).payload)
    damaged[-1] ^= 0x40  # one byte of the body: the CRC, not the header, catches it
    with pytest.raises(ChecksumMismatchError, match="DENSE"):
        decode(bytes(damaged), base, inplace=True)
    assert same_bits(base, torch.zeros(16))  # checked before the copy, as the docstring says


def test_corrupted_payload_is_detected():
    old = torch.randn(4000)
    new = old.clone()
    new[::50] *= 2
    for encoded in (encode_delta(old, new), encode_dense(new)):
        damaged = bytearray(encoded.payload)
        damaged[-3] ^= 0x10
        with pytest.raises(ChecksumMismatchError):
            decode(bytes(damaged), old)
        with pytest.raises(DeltaCodecError, match="truncated"):
            decode(encoded.payload[:-1], old)


def test_shape_or_dtype_mismatch_is_refused_with_the_shapes_named():
    with pytest.raises(DeltaCodecError, match=r"\(4, 2\)"):
        encode_delta(torch.zeros(4, 2), torch.zeros(2, 4))
    with pytest.raises(DeltaCodecError, match="base tensor is"):
        decode(encode_delta(torch.zeros(8), torch.ones(8)), torch.zeros(8, dtype=torch.float16))


def test_checksum_covers_raw_bits_and_mismatch_names_the_tensor():
    zero = torch.tensor([0.0])
    assert tensor_checksum(zero) != tensor_checksum(torch.tensor([-0.0]))
    assert tensor_checksum(torch.arange(6.0).reshape(2, 3).t()) == tensor_checksum(
        torch.tensor([[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]))
    with pytest.raises(ChecksumMismatchError, match="layers.0.q_proj"):
        verify_checksum("layers.0.q_proj", zero, tensor_checksum(zero) ^ 1)
    verify_checksum("ok", zero, tensor_checksum(zero))


def test_other_dtypes_and_empty_tensors_round_trip():
    for t in (torch.arange(10, dtype=torch.int64), torch.tensor([True, False]),
              torch.zeros(0, 3), torch.tensor(3.5, dtype=torch.float64)):
        changed = t.clone()
        if changed.numel():
            changed.view(-1)[0] = 1 if t.dtype != torch.bool else False
        assert same_bits(decode(encode_delta(t, changed), t), changed)
        assert np.array_equal(decode(encode_dense(t)).numpy(), t.numpy())
