"""Layout discovery, rejection of unsupported tensors, and slot -> row arithmetic."""

from __future__ import annotations

import pytest
import torch
from gpu_kvgen import GEOMETRY, make_caches, random_requests, reference_token

from kvstore.gpu.layout import (
    KVLayout,
    LayoutError,
    SlotMappingError,
    check_slot_mapping,
    discover_layout,
)


def test_discovers_each_layout(layout):
    caches = make_caches(layout)
    lay = discover_layout(caches)
    g = GEOMETRY[layout]
    assert lay.kind is KVLayout(layout)
    assert (lay.num_layers, lay.num_blocks, lay.block_size) == (
        g["num_layers"],
        g["num_blocks"],
        g["block_size"],
    )
    assert lay.width == g["heads"] * g["head_size"]
    assert lay.kv_size == (1 if layout == "mla" else 2)
    assert lay.chunk_shape(5) == (lay.kv_size, g["num_layers"], 5, lay.width)


def test_rows_address_the_same_token_as_plain_indexing(layout):
    caches = make_caches(layout)
    lay = discover_layout(caches)
    slots = random_requests([37], num_blocks=lay.num_blocks, block_size=lay.block_size).slots[0]
    table = lay.row_view(caches[1])
    rows = lay.rows(slots)
    tm = lay.rows(slots, token_major=True)
    for i, s in enumerate(slots.tolist()):
        want = reference_token(layout, caches[1], s, lay.block_size)
        for k in range(lay.kv_size):
            assert torch.equal(table[rows[k, i]], want[k])
            assert torch.equal(table[tm[i * lay.kv_size + k]], want[k])


def test_ambiguous_shape_needs_a_hint():
    caches = make_caches("flash_attn", num_blocks=2)  # [2, 2, bs, h, d]
    with pytest.raises(LayoutError, match="ambiguous"):
        discover_layout(caches)
    assert discover_layout(caches, "flash_attn").kind is KVLayout.FLASH_ATTN
    assert discover_layout(caches, "flash_infer").kind is KVLayout.FLASH_INFER


def test_hint_that_contradicts_the_shape_is_rejected():
    with pytest.raises(LayoutError, match="does not match"):
        discover_layout(make_caches("flash_attn"), "flash_infer")
    with pytest.raises(LayoutError, match="does not match"):
        discover_layout(make_caches("mla"), "flash_attn")
    with pytest.raises(LayoutError, match="unknown KV layout"):
        discover_layout(make_caches("mla"), "paged_v9")


@pytest.mark.parametrize(
    "bad, message",
    [
        ([torch.zeros(4, 8, 2, 6)], "4-D"),  # legacy per-K/V tensors
        ([torch.zeros(3, 4, 8, 2, 6)], "not a supported layout"),
        ([], "empty"),
        (torch.zeros(2, 4, 8, 2, 6), "list of per-layer tensors"),
        ([torch.zeros(2, 4, 8, 2, 6), torch.zeros(2, 5, 8, 2, 6)], "all layers must match"),
        (
            [torch.zeros(2, 4, 8, 2, 6), torch.zeros(2, 4, 8, 2, 6, dtype=torch.float16)],
            "all layers must match",
        ),
        ([torch.zeros(2, 4, 2, 8, 6).transpose(2, 3)], "contiguous"),  # HND viewed as NHD
        ([(torch.zeros(4, 8, 2, 6), torch.zeros(4, 8, 2, 6))], "each layer must be one tensor"),
    ],
)
def test_unsupported_tensors_are_rejected_with_a_reason(bad, message):
    with pytest.raises(LayoutError, match=message):
        discover_layout(bad)


def test_slot_mapping_checks():
    assert check_slot_mapping([3, 1, 2], 8).dtype == torch.int64
    assert check_slot_mapping(torch.tensor([0, 7], dtype=torch.int32), 8).dtype == torch.int64
    with pytest.raises(SlotMappingError, match="negative"):
        check_slot_mapping(torch.tensor([-1, 2]), 8)
    with pytest.raises(SlotMappingError, match="8 slots"):
        check_slot_mapping(torch.tensor([1, 8]), 8)
    with pytest.raises(SlotMappingError, match="1-D"):
        check_slot_mapping(torch.zeros(2, 2, dtype=torch.int64), 8)
    with pytest.raises(SlotMappingError, match="integers"):
        check_slot_mapping(torch.zeros(2), 8)
