"""The worker's structure cache on its own (no worker process): what a request must carry for the
worker to write the right tensors. The cache slots are what lets one worker serve Lightning's two
saves of an event (the trainer's tensors in slot 0, a held copy of them in slot 1) without either
resending every tensor."""

from __future__ import annotations

import pytest
import torch

from asyncckpt.protocol import CACHE_SLOTS, TENSOR, ItemIndex, ItemSpec, SaveRequest, WriteOptions
from asyncckpt_worker.cache import CacheMiss, StructureCache


def items(*names: str) -> tuple[ItemSpec, ...]:
    return tuple(ItemSpec(ItemIndex(name), TENSOR, torch.float32, (2,)) for name in names)


def request(key: str, slot: int = 0, **fields) -> SaveRequest:
    return SaveRequest(save_id=0, checkpoint_dir="/unused", structure_key=key, options=WriteOptions(), slot=slot, **fields)


def tensors(*values: float) -> dict[int, torch.Tensor]:
    return {pos: torch.full((2,), value) for pos, value in enumerate(values)}


def test_a_structure_is_sent_once_then_named_by_its_key():
    cache = StructureCache()
    sent = tensors(1.0, 2.0)
    entry, hit = cache.apply(request("A", items=items("a", "b"), fresh_tensors=dict(sent)))
    assert not hit and entry.sources == [sent[0], sent[1]]
    entry, hit = cache.apply(request("A"))  # a steady save: the key alone
    assert hit and entry.sources[0] is sent[0] and entry.sources[1] is sent[1]
    moved = torch.full((2,), 9.0)  # the trainer reallocated one tensor: only it travels
    entry, hit = cache.apply(request("A", fresh_tensors={1: moved}))
    assert hit and entry.sources[0] is sent[0] and entry.sources[1] is moved


def test_each_slot_keeps_its_own_structure():
    """A held copy's structure in slot 1 does not evict the trainer's in slot 0, and back."""
    cache = StructureCache()
    own, held = tensors(1.0, 2.0), tensors(5.0, 6.0)
    cache.apply(request("A", slot=0, items=items("a", "b"), fresh_tensors=dict(own)))
    cache.apply(request("B", slot=1, items=items("a", "b"), fresh_tensors=dict(held)))
    entry, hit = cache.apply(request("A", slot=0))
    assert hit and entry.sources == [own[0], own[1]]
    entry, hit = cache.apply(request("B", slot=1))
    assert hit and entry.sources == [held[0], held[1]]
    with pytest.raises(CacheMiss, match="not cached"):  # a key is found in its own slot only
        cache.apply(request("A", slot=1))


def test_a_new_structure_keeps_the_tensors_the_worker_holds_under_the_previous_one():
    """Lightning's top-k paths change a few keys: the tensors that stay are named by position."""
    cache = StructureCache()
    sent = tensors(1.0, 2.0)
    cache.apply(request("A", items=items("a", "b"), fresh_tensors=dict(sent)))
    extra = torch.full((2,), 3.0)
    entry, hit = cache.apply(request("C", items=items("b", "a", "c"), kept_from="A", kept_tensors={0: 1, 1: 0},
                                     fresh_tensors={2: extra}))
    assert not hit and entry.sources[0] is sent[1] and entry.sources[1] is sent[0] and entry.sources[2] is extra
    with pytest.raises(CacheMiss, match="not cached"):  # the new structure replaced the old one in its slot
        cache.apply(request("A"))


def test_what_the_worker_does_not_hold_is_a_cache_miss_not_a_wrong_checkpoint():
    cache = StructureCache()
    with pytest.raises(CacheMiss, match="not cached"):
        cache.apply(request("A"))  # a key before its structure (e.g. a fresh worker)
    with pytest.raises(CacheMiss, match="no tensor held"):
        cache.apply(request("A", items=items("a", "b"), fresh_tensors={0: torch.ones(2)}))
    assert cache.slots[0] is None  # the incomplete structure is not kept
    cache.apply(request("A", items=items("a"), fresh_tensors=tensors(1.0)))
    with pytest.raises(CacheMiss, match="to keep tensors from is not cached"):
        cache.apply(request("B", items=items("a"), kept_from="Z", kept_tensors={0: 0}))
    with pytest.raises(CacheMiss, match=f"no cache slot {CACHE_SLOTS} .this worker has {CACHE_SLOTS}"):
        cache.apply(request("A", slot=CACHE_SLOTS))
