"""Stand-ins for memory a CPU probe cannot have: metadata buffer slots, the token-to-KV page
pool (pages owned by request ids, with counters), the radix cache, and the module-level cache
helpers that return a request's pages.
"""

from __future__ import annotations

from . import Ledger, drop_kv_row


class RecordingReqToMetadataIdxAllocator:
    """Stands for ``ReqToMetadataIdxAllocator``: metadata buffer slots, with counters."""

    def __init__(self, ledger: Ledger, size: int = 8) -> None:
        self.ledger = ledger
        self.free_slots = list(range(size))
        self.size = size

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self):
        idx = self.free_slots.pop(0)
        self.ledger.record("metadata_alloc", idx=idx)
        return idx

    def free(self, idx, *args, **kwargs) -> None:
        idx = int(idx)
        if idx in self.free_slots:
            self.ledger.record("metadata_double_free", idx=idx)
            return
        self.ledger.record("metadata_free", idx=idx)
        self.free_slots.append(idx)


class ReqToTokenPoolStandIn:
    """Stands for ``ReqToTokenPool``: one row of token slots per request, and its free list."""

    def __init__(self, ledger: Ledger, size: int = 8) -> None:
        self.ledger = ledger
        self.rows: dict[int, list[int]] = {}
        self.free_slots = list(range(size))
        self.req_to_token = _Rows(self.rows)

    def available_size(self) -> int:
        return len(self.free_slots)

    def assign(self, slots: list[int]) -> int:
        row = self.free_slots.pop(0)
        self.rows[row] = list(slots)
        return row

    def free(self, row) -> None:
        row = int(row)
        if row in self.free_slots:
            self.ledger.record("req_row_double_free", row=row)
            return
        self.rows.pop(row, None)
        self.free_slots.append(row)
        self.ledger.record("req_row_free", row=row)


class _Rows:
    """``req_to_token[row, :n]``: the first n slots of a row (a list: what the pools here take)."""

    def __init__(self, rows: dict[int, list[int]]) -> None:
        self.rows = rows

    def __getitem__(self, key) -> list[int]:
        row, cols = key
        return self.rows[int(row)][cols]


class MetadataBuffersStandIn:
    """Stands for ``MetadataBuffers``: only the room column the queues reset."""

    def __init__(self, size: int = 8) -> None:
        self.bootstrap_room = [0] * size

    def clear_slot(self, idx: int) -> None:
        """0.5.23 resets a freed slot's room, so its next owner reads "not yet written"."""
        self.bootstrap_room[idx] = 0


class CountingTokenToKVPoolAllocator:
    """Stands for a token-to-KV page pool. Pages are owned by request ids; the
    counters tell how many pages were reserved, returned, and returned twice."""

    def __init__(self, ledger: Ledger, name: str, num_pages: int, page_size: int):
        self.ledger = ledger
        self.name = name
        self.page_size = page_size
        self.num_pages = num_pages
        self.free_pages = list(range(num_pages))
        self.owned: dict[str, list[int]] = {}
        self.released_owners: set = set()
        # Token slots (page * page_size + offset) each owner's reservation covers: what the
        # release's own free(indices) gives back, counted slot by slot.
        self.slots: dict[str, set[int]] = {}

    @property
    def size(self) -> int:
        return self.num_pages * self.page_size

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def reserve(self, owner: str, num_tokens: int) -> list[int]:
        n = self.pages_for(num_tokens)
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        self.owned.setdefault(owner, []).extend(pages)
        self.slots.setdefault(owner, set()).update(self.token_slots(pages)[:num_tokens])
        self.ledger.record("pages_reserved", pool=self.name, owner=owner, pages=n)
        return pages

    def token_slots(self, pages: list[int]) -> list[int]:
        return [page * self.page_size + offset for page in pages for offset in range(self.page_size)]

    def free(self, indices) -> None:
        """The allocator's own ``free(indices)`` (a release that frees a request's row itself):
        slot by slot; an owner's pages go back once every slot it reserved was freed, so a
        release that frees one slot too few keeps the pages held."""
        freed = {int(i) for i in indices}
        for owner, slots in list(self.slots.items()):
            taken = slots & freed
            if taken:
                slots -= taken
                freed -= taken
                if not slots:
                    self.release(owner)
        if freed:  # slots no reservation holds: freed twice, or never reserved
            self.ledger.record("slots_freed_unowned", pool=self.name, slots=len(freed))

    def release(self, owner: str) -> int:
        self.slots.pop(owner, None)
        pages = self.owned.pop(owner, None)
        if pages is None:
            if owner in self.released_owners:
                self.ledger.record("pages_double_release", pool=self.name, owner=owner)
            return 0
        self.released_owners.add(owner)
        already_free = set(pages) & set(self.free_pages)
        if already_free:  # after a clear(): the owner's row still names pages the pool gave back
            self.ledger.record("pages_double_release", pool=self.name, owner=owner, pages=len(already_free))
        self.free_pages.extend(pages)
        self.ledger.record("pages_released", pool=self.name, owner=owner, pages=len(pages))
        return len(pages)

    def held_by(self, owner: str) -> int:
        return len(self.owned.get(owner, ()))

    def clear(self) -> None:
        """The allocator's clear() (a flush): every page back on the free list. Like the real
        pool it cannot know which pages a request's row still names, so `owned` is kept."""
        self.free_pages = list(range(self.num_pages))
        self.ledger.record("pool_cleared", pool=self.name)

    def pages_listed_twice(self) -> int:
        return len(self.free_pages) - len(set(self.free_pages))


class RecordingRadixCache:
    """Stands for the radix cache: records prefix inserts and abort bookkeeping."""

    cache_controller = None

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def cache_unfinished_req(self, req, *args, **kwargs):
        self.ledger.record("cache_unfinished", rid=req.rid, via="tree_cache")

    def checkpoint(self, req, *args, **kwargs):
        self.ledger.record("cache_unfinished", rid=req.rid, via="tree_cache.checkpoint")

    def advance_unpublished_req(self, req, *args, **kwargs):
        self.ledger.record("cache_unfinished", rid=req.rid, via="advance_unpublished")

    def finish(self, handle, outcome=None, *args, **kwargs):
        self.ledger.record("tree_finish", outcome=getattr(outcome, "name", str(outcome)))

    def release_aborted_request(self, rid):
        self.ledger.record("tree_release_aborted", rid=rid)

    pages = None  # the shell's page pool (make_scheduler_shell), for the call below

    def cache_finished_req(self, req, is_insert=True, *args, **kwargs):
        """Up to 0.5.5 (before the `release_kv_cache` helper) the tree frees a finished request's
        KV itself: recorded as that helper's stand-in records it (patch_cache_helpers). The real
        caches name `is_insert` in their signature (a patch may ask for it), so this one does."""
        insert = is_insert
        freed = self.pages.release(req.rid) if self.pages is not None else 0
        drop_kv_row(req)
        self.ledger.record("release_kv_cache", rid=req.rid, insert=bool(insert), pages=freed)

    def supports_mamba(self) -> bool:
        return False

    def inc_lock_ref(self, *args, **kwargs):
        return None

    def dec_lock_ref(self, *args, **kwargs):
        return None

    def unlock(self, *args, **kwargs):
        return None


def patch_cache_helpers(ctx, ledger: Ledger, module, pages: CountingTokenToKVPoolAllocator | None):
    """Swap the module-level cache helpers ``module`` calls for recorders.

    ``release_kv_cache`` returns the request's pages to ``pages`` and records
    whether the prefix was inserted into the tree (``is_insert`` up to 0.5.21,
    ``checkpoint`` from 0.5.22; both default to inserting).
    """

    def release_kv_cache(req, tree_cache, *args, **kwargs):
        insert = kwargs.get("is_insert", kwargs.get("checkpoint", args[0] if args else True))
        freed = pages.release(req.rid) if pages is not None else 0
        drop_kv_row(req)
        ledger.record("release_kv_cache", rid=req.rid, insert=bool(insert), pages=freed)

    def maybe_cache_unfinished_req(req, tree_cache, *args, **kwargs):
        ledger.record("cache_unfinished", rid=req.rid, via="maybe_cache_unfinished_req")

    def checkpoint_kv_cache(req, tree_cache, *args, **kwargs):
        ledger.record("cache_unfinished", rid=req.rid, via="checkpoint_kv_cache")

    def discard_kv_cache_backup(req, *args, **kwargs):
        ledger.record("discard_backup", rid=req.rid)

    ctx.patch_if_present(module, "release_kv_cache", release_kv_cache)
    ctx.patch_if_present(module, "maybe_cache_unfinished_req", maybe_cache_unfinished_req)
    ctx.patch_if_present(module, "checkpoint_kv_cache", checkpoint_kv_cache)
    ctx.patch_if_present(module, "discard_kv_cache_backup", discard_kv_cache_backup)
