"""Page-locked host memory on huge pages (mempath/memory/pinned.py): the expert host store's bytes."""
import gc

import pytest
import torch

from mempath.memory.pinned import huge_page_empty, pinned_empty, transparent_huge_pages


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_huge_page_tensor_holds_what_is_written_and_outlives_its_base_through_views(dtype):
    base = huge_page_empty((3, 1024, 700), dtype)
    assert base.shape == (3, 1024, 700) and base.dtype == dtype and base.is_contiguous()
    values = torch.arange(base.numel()).reshape(base.shape).to(dtype)
    base.copy_(values)
    view = base[2]
    del base
    gc.collect()
    assert torch.equal(view, values[2])


def test_empty_shapes_and_the_thp_mode():
    assert huge_page_empty((0, 4), torch.float32).shape == (0, 4)
    assert pinned_empty((0,), torch.bfloat16).numel() == 0
    assert transparent_huge_pages() in ("always", "madvise", "never", "unknown")


def test_moe_host_store_is_on_it_where_it_is_pinned(model_factory, monkeypatch):
    from mempath import LLM
    from mempath.model import moe
    from mempath.model.moe import set_expert_cache_size
    path, _ = model_factory("mixtral")
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False, enable_prefix_caching=False)
    made = []

    def recording(shape, dtype):
        made.append((tuple(shape), dtype))
        return huge_page_empty(shape, dtype)
    monkeypatch.setattr(moe, "pinned_empty", recording)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a store is pinned only where CUDA is
    set_expert_cache_size(llm.engine.model, 2)
    blocks = llm.engine.model.moe_blocks()
    host = blocks[0].experts.cache.host
    assert len(made) == 2 * len(blocks)
    assert made[:2] == [(tuple(host["gate_up_proj"].shape), torch.float32), (tuple(host["down_proj"].shape), torch.float32)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_registration_pins_and_ends_with_the_tensor():
    base = pinned_empty((4, 1 << 20), torch.bfloat16)
    view = base[1]
    assert base.is_pinned() and view.is_pinned()
    base.normal_()
    on_device = base.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(on_device.cpu(), base)
    expected = view.clone()
    del base
    gc.collect()
    assert not view.is_pinned() and torch.equal(view, expected)  # unregistered, still mapped
