"""ROSE §4.2 shard-aware transfer: every rank gets exactly its TP slice, from any training TP."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlharvest.models.tiny_model import build_model
from rlharvest.services.transfer_agent.sharding import (
    Layout,
    ShardingError,
    gather_shards,
    layout_of,
    remap_pieces,
    reshard,
    shard_shape,
    take_shard,
)

TP_SIZES = (1, 2, 4)  # "small" has 4 KV heads: TP up to 4 keeps heads whole


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # Small tensors on a shared 2-core box: intra-op threads only contend (5x slower copies).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def small_state() -> dict[str, torch.Tensor]:
    return dict(build_model("small", seed=0).state_dict())


def test_every_qwen3_tensor_has_the_megatron_layout(small_state):
    expected = {
        "q_proj": Layout.COLUMN, "k_proj": Layout.COLUMN, "v_proj": Layout.COLUMN,
        "gate_proj": Layout.COLUMN, "up_proj": Layout.COLUMN, "embed_tokens": Layout.COLUMN,
        "lm_head": Layout.COLUMN, "o_proj": Layout.ROW, "down_proj": Layout.ROW,
        "q_norm": Layout.REPLICATED, "k_norm": Layout.REPLICATED,
        "input_layernorm": Layout.REPLICATED, "post_attention_layernorm": Layout.REPLICATED,
        "norm": Layout.REPLICATED,
    }
    for name, tensor in small_state.items():
        module = name.split(".")[-2]
        assert layout_of(name, tensor.shape) == expected[module], name


@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_shards_tile_the_full_tensor_and_gather_is_their_inverse(small_state, tp_size):
    for name, full in small_state.items():
        shards = [take_shard(name, full, r, tp_size) for r in range(tp_size)]
        assert all(s.shape == shard_shape(name, full.shape, tp_size) for s in shards)
        assert torch.equal(gather_shards(name, shards), full), name
        layout = layout_of(name, full.shape)
        if layout == Layout.COLUMN:  # the rank's rows, in rank order
            rows = full.shape[0] // tp_size
            assert all(torch.equal(s, full[r * rows:(r + 1) * rows]) for r, s in enumerate(shards))
        elif layout == Layout.ROW:
            cols = full.shape[1] // tp_size
            assert all(torch.equal(s, full[:, r * cols:(r + 1) * cols])
                       for r, s in enumerate(shards))
        else:
            assert all(torch.equal(s, full) for s in shards)


@pytest.mark.parametrize("src_tp, dst_tp", [(1, 4), (4, 1), (2, 4), (4, 2), (4, 4), (2, 1)])
def test_training_shards_remap_to_any_worker_tp_size_without_a_full_gather(
        small_state, src_tp, dst_tp):
    for name, full in small_state.items():
        training = [take_shard(name, full, r, src_tp).clone() for r in range(src_tp)]
        for dst_rank in range(dst_tp):
            assert torch.equal(reshard(name, training, dst_rank, dst_tp),
                               take_shard(name, full, dst_rank, dst_tp)), (name, dst_rank)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([1, 2, 3, 4, 6, 8, 12]), st.sampled_from([1, 2, 3, 4, 6, 8, 12]),
       st.integers(1, 4), st.data())
def test_remap_pieces_cover_the_destination_exactly_once(src_tp, dst_tp, mult, data):
    rows = 24 * mult  # divisible by every TP size drawn
    dst_rank = data.draw(st.integers(0, dst_tp - 1))
    pieces = remap_pieces("model.layers.0.mlp.up_proj.weight", (rows, 8), src_tp, dst_rank, dst_tp)
    covered = [i for p in pieces for i in range(p.dst_start, p.dst_stop)]
    assert covered == list(range(rows // dst_tp))
    for p in pieces:  # each piece's source rows are the same global rows as its destination rows
        global_row = p.src_rank * (rows // src_tp) + p.src_start
        assert global_row == dst_rank * (rows // dst_tp) + p.dst_start
        assert 0 <= p.src_start < p.src_stop <= rows // src_tp


def test_shapes_not_divisible_by_tp_size_are_refused_with_the_fix():
    with pytest.raises(ShardingError, match="not divisible by tp_size=3"):
        take_shard("model.layers.0.self_attn.q_proj.weight", torch.zeros(256, 64), 0, 3)
    with pytest.raises(ShardingError, match="not divisible by tp_size=3"):
        reshard("model.layers.0.mlp.down_proj.weight", [torch.zeros(64, 128)], 0, 3)


def test_unknown_parameters_and_bad_ranks_are_refused():
    with pytest.raises(ShardingError, match="no tensor-parallel rule"):
        layout_of("vision.patch_embed.proj.weight", (8, 8))
    with pytest.raises(ShardingError, match="not a rank"):
        take_shard("model.norm.weight", torch.zeros(8), 2, 2)
    with pytest.raises(ShardingError, match="shard 1"):
        gather_shards("lm_head.weight", [torch.zeros(4, 8), torch.zeros(3, 8)])
    with pytest.raises(ShardingError, match="at least 2 dims"):
        layout_of("model.layers.0.self_attn.o_proj.weight", (8,))
