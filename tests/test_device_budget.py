"""DeviceBudget: every tenant's grants come out of one limit, and each tenant's ledger holds them."""
import pytest

from mempath.memory.budget import DeviceBudget
from mempath.memory.ledger import Pathway

MiB = 1 << 20


def test_two_tenants_share_one_limit():
    budget = DeviceBudget("cuda", 1000 * MiB)
    budget.grant("large", Pathway.WEIGHTS, 600 * MiB)
    budget.grant("small", Pathway.WEIGHTS, 100 * MiB)
    assert budget.remaining() == 300 * MiB
    # The large model's KV cache gets what neither tenant holds, in whole blocks.
    assert budget.grant_blocks("large", Pathway.KV_CACHE, 64 * MiB) == 4
    assert budget.remaining() == 300 * MiB - 256 * MiB
    assert budget.ledger("large").get(Pathway.KV_CACHE) == 256 * MiB
    assert budget.ledger("small").get(Pathway.KV_CACHE) == 0


def test_a_later_grant_replaces_the_estimate_and_host_memory_is_not_granted():
    budget = DeviceBudget("cuda", 1000 * MiB)
    budget.grant("m", Pathway.CUDA_GRAPHS, 200 * MiB, "derived")
    budget.grant("m", Pathway.CUDA_GRAPHS, 150 * MiB, "measured")
    budget.ledger("m").record(Pathway.KV_CPU, 4000 * MiB, "cpu")  # the host tier: not the device's
    assert budget.granted() == 150 * MiB
    assert budget.ledger("m").entries["cuda_graphs"].source == "measured"


def test_blocks_leave_room_for_the_allocators_rounding():
    """PyTorch's caching allocator may round a large tensor up to the next 2 MiB (measured on an H100: a
    pool of 1,492,712 pages of 16 KiB took 393,216 B more), so the blocks granted leave that much of what
    remains for each allocation they will be: the tensors, rounded, still fit the budget."""
    budget = DeviceBudget("cuda", 64 * 4 * MiB + MiB)
    assert budget.grant_blocks("m", Pathway.KV_CACHE, 64 * MiB, allocations=1) == 3  # 4 would leave 1 MiB
    two = DeviceBudget("cuda", 64 * 4 * MiB + 4 * MiB)  # a target's and a draft's tensors
    assert two.grant_blocks("m", Pathway.KV_CACHE, 64 * MiB, allocations=2) == 4
    assert DeviceBudget("cuda", 64 * 4 * MiB + 4 * MiB - 1).grant_blocks(
        "m", Pathway.KV_CACHE, 64 * MiB, allocations=2) == 3


def test_nothing_left_grants_no_block():
    budget = DeviceBudget("cuda", 100 * MiB)
    budget.grant("m", Pathway.WEIGHTS, 120 * MiB)
    assert budget.grant_blocks("m", Pathway.KV_CACHE, MiB) == 0


def test_a_name_that_is_no_pathway_is_refused():
    with pytest.raises(ValueError):
        DeviceBudget("cuda", MiB).grant("m", "kv_cahce", 1)


def test_the_cpu_has_no_device_budget_to_take_from():
    budget = DeviceBudget("cpu", None)
    budget.grant("m", Pathway.WEIGHTS, MiB)
    with pytest.raises(ValueError, match="cpu_kv_cache_bytes"):
        budget.remaining()
