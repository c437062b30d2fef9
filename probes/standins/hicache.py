"""Decode HiCache (L2 host -> L1 device load-back) for probes: the tree's real
``HiRadixCache`` lock, load-back and eviction methods on a CPU shell.

Real: ``HiRadixCache.load_back`` (device pages allocated through the cache
controller's real ``load``, the tree's own in-flight lock), ``inc_lock_ref`` /
``dec_lock_ref``, ``loading_check`` and ``evict``, on real ``TreeNode``s.
Stand-ins: the device page allocator (counts pages, records frees), the DMA's
CUDA events (``LoadDma``: done or not, as the case says), the TP all-reduce of
the finished-load count (one rank), KV events and metrics (none).
"""

from __future__ import annotations

from types import SimpleNamespace


class DevicePages:
    """Stands for the device page allocator: hands out page ids, records frees."""

    def __init__(self, size: int = 512) -> None:
        self.free_ids = list(range(1, size + 1))
        self.freed: list[int] = []

    def alloc(self, n: int):
        import torch

        if len(self.free_ids) < n:
            return None
        out, self.free_ids = self.free_ids[:n], self.free_ids[n:]
        return torch.tensor(out, dtype=torch.int64)

    def free(self, indices) -> None:
        ids = [int(i) for i in indices.tolist()]
        self.freed.extend(ids)
        self.free_ids.extend(ids)

    def available_size(self) -> int:
        return len(self.free_ids)


class LoadDma:
    """Stands for a queued L2->L1 copy's CUDA event: ``query()`` is whether the
    copy finished; ``synchronize()`` on an unfinished one is a probe error."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        assert self.done, "probe: synchronize on a load-back still running"


def restore_tree(ledger) -> SimpleNamespace:
    """A ``HiRadixCache`` with one evicted, host-backed 32-token node under the
    root, and the real methods decode's restore uses."""
    import torch
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
    from sglang.srt.mem_cache.radix_cache import TreeNode

    pages = DevicePages()
    controller = object.__new__(HiCacheController)
    controller.mem_pool_device_allocator = pages
    controller.load_queue, controller.ack_load_queue = [], []
    controller.write_policy = "write_through"
    controller.evict_device = pages.free
    dma = LoadDma()
    controller.layer_done_counter = SimpleNamespace(
        events=[SimpleNamespace(finish_event=dma)], producer_index=0, num_counters=1
    )
    tree = object.__new__(HiRadixCache)
    attrs = {
        "disable": False,
        "cache_controller": controller,
        "evictable_size_": 0,
        "protected_size_": 0,
        "evictable_leaves": set(),
        "evictable_host_leaves": set(),
        "ongoing_load_back": {},
        "load_back_threshold": 1,
        "pp_rank": 0,
        "metrics_collector": None,
        "page_size": 1,
        "enable_storage": False,
        "enable_kv_cache_events": False,
        "kv_events": SimpleNamespace(record_store=lambda *a, **k: None, record_remove=lambda *a, **k: None),
    }
    for name, value in attrs.items():
        setattr(tree, name, value)
    from sglang.srt.mem_cache import radix_cache

    tree.eviction_strategy = radix_cache.get_eviction_strategy("lru")  # the default policy
    tree._all_reduce = lambda tensor, op: None  # one rank
    tree._get_extra_pools = dict
    tree.update_eviction_metrics = lambda *a, **k: None
    tree.release_aborted_request = lambda rid: ledger.record("tree_release_aborted", rid=rid)
    root = TreeNode()
    root.key, root.value, root.lock_ref = [], torch.tensor([], dtype=torch.int64), 1
    tree.root_node = root
    node = TreeNode()
    node.parent, node.key, node.value, node.host_value = root, list(range(32)), None, torch.arange(32)
    root.children[0] = node
    return SimpleNamespace(tree=tree, node=node, pages=pages, dma=dma, controller=controller)


def start_load_back(hc) -> list[int]:
    """What decode's ``_try_hicache_queue_load_back`` and
    ``ready_to_load_host_cache`` leave: the tree's real ``load_back`` of the
    node (device pages allocated, the tree's in-flight lock), decode's own lock
    on the restored node, and the copy launched with an unfinished event."""
    indices = hc.tree.load_back(hc.node)
    assert indices is not None, "probe: load_back found no device pages"
    hc.tree.inc_lock_ref(hc.node)
    ops, hc.controller.load_queue = hc.controller.load_queue, []
    hc.controller.ack_load_queue.append(
        SimpleNamespace(
            finish_event=hc.dma,
            node_ids=[op.node_ids[0] if hasattr(op, "node_ids") else op.node_id for op in ops],
            num_tokens=len(indices),
            num_tokens_by_pool={},
            num_bytes=0,
            timing_enabled=False,
        )
    )
    return [int(i) for i in indices.tolist()]


def evict_all(hc) -> int:
    """The tree's real ``evict`` asked for every device token (memory pressure)."""
    from sglang.srt.mem_cache import base_prefix_cache

    params = getattr(base_prefix_cache, "EvictParams", None)
    result = hc.tree.evict(params(num_tokens=10_000) if params else 10_000)
    return int(getattr(result, "num_tokens_evicted", 0) or 0)
