"""The block manager: which KV pages each sequence owns, shared pages, and the prefix cache.

Pages have reference counts. A page full of computed tokens is registered under a hash chained from its
predecessor's (so equal hashes mean equal whole prefixes); a new sequence whose prompt starts with
registered pages takes them instead of recomputing them. Past its whole pages, a prompt is matched token by
token against every page registered under the same prefix, full or partly filled (a finished chat turn's
last page, a running sequence's page being filled): the best match's tokens are copied into a page of the
new sequence, so a follow-up turn or a request sharing a short system prompt computes only what is new,
however it falls on page boundaries (as SGLang's radix cache does; vLLM matches whole blocks only). A page
freed by its last owner keeps its contents and registration and goes to the back of the free queue: it can
still be found by a later request until the pool needs it for new tokens (least recently freed first). A
write into a shared page first copies it (copy on write), as forked sequences need.

New tokens go first to freed pages that hold nothing worth keeping (most recently freed first), then to
pages never used, and only then to cached ones. The pool's memory is mapped lazily (cann_llm/runtime/engine/kv_cache.py):
a page never written costs a page fault per 4 KB on its first write (SmolLM2: ~1,400 for a 128-token
page across its 30 layers), and a freed page is resident and likely still in the CPU's caches.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from cann_llm.runtime.engine.sequence import Sequence


@dataclass
class _Page:
    ref_count: int = 0
    hash: int | None = None              # registered as a whole page under this hash
    parent: int | None = None            # registered (whole or in part) after the prefix of this hash
    tokens: tuple[int, ...] | None = None  # the tokens it holds, when registered
    written: bool = False                # ever allocated: its memory is resident


class BlockManager:
    """Pages `0 .. num_pages-1` of `page_size` tokens each."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        self.page_size = page_size
        self.num_pages = num_pages
        self.enable_prefix_caching = enable_prefix_caching
        self._pages = [_Page() for _ in range(num_pages)]
        # free pages without contents, taken from the end (page 0 first, then the latest freed)
        self._blank: OrderedDict[int, None] = OrderedDict.fromkeys(reversed(range(num_pages)))
        # free pages holding cached prefixes, least recently freed first
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[int, int] = {}
        # every registered page by the prefix it follows and its first token: the candidates of a partial match
        self._after: dict[tuple[int | None, int], set[int]] = {}
        self.pending_copies: list[tuple[int, int, int]] = []  # (source, target, leading tokens to copy)
        self.prefix_hits = 0
        self.prefix_queries = 0
        self.peak_used = 0
        self.touched = 0  # pages ever allocated (the pool's memory is mapped lazily: these are resident)

    @property
    def num_free(self) -> int:
        return len(self._blank) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def limit_pages(self, pages: int) -> int:
        """Use at most `pages` pages (never fewer than those written already): pages never written past that
        are dropped, so the pool's memory stays within a budget however much the prefix cache keeps (cached
        pages are then reused for new tokens sooner). Only before requests run. Returns the pages kept."""
        pages = min(self.num_pages, max(pages, self.touched))
        unwritten = [page for page in self._blank if not self._pages[page].written]
        for page in unwritten[:self.num_pages - pages]:
            del self._blank[page]
        self.num_pages = pages
        return pages

    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New pages `seq` needs to hold its first `num_tokens` tokens (a shared last page counts once more)."""
        needed = max(0, -(-num_tokens // self.page_size) - len(seq.block_table))
        if self._needs_copy(seq, num_tokens):
            needed += 1
        return needed

    def can_hold(self, seq: Sequence, num_tokens: int) -> bool:
        return self.pages_needed(seq, num_tokens) <= self.num_free

    def claim_prefix(self, seq: Sequence) -> int:
        """Give a new sequence the cached pages its prompt starts with, and a copy of the best partial match
        after them; returns the tokens they cover (counted in `prefix_queries` / `prefix_hits`, as vLLM counts).

        The last prompt token is never taken from the cache: its logits are needed, so it is computed.
        """
        assert not seq.block_table and seq.num_computed == 0
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return 0  # (a sequence that wants its prompt's log-probabilities computes every prompt token)
        reusable = seq.num_prompt - 1
        parent = seq.cache_salt
        for index in range(reusable // self.page_size):
            key = self._hash(parent, seq.token_ids, index)
            page = self._by_hash.get(key)
            if page is None:
                break
            self._take(page)
            seq.block_table.append(page)
            parent = key
        cached = len(seq.block_table) * self.page_size
        cached += self._copy_best_match(seq, parent, seq.token_ids[cached:min(reusable, cached + self.page_size)])
        seq.num_computed = seq.stats.cached_tokens = cached
        self.prefix_queries += seq.num_prompt
        self.prefix_hits += cached
        return cached

    def _copy_best_match(self, seq: Sequence, parent: int | None, wanted: list[int]) -> int:
        """Copy into a new page of `seq` the registered page after `parent` whose tokens start most like
        `wanted`; returns how many match (0: none, nothing taken)."""
        if not wanted or not self.num_free:
            return 0
        best, matched = None, 0
        for page in self._after.get((parent, wanted[0]), ()):
            held = self._pages[page].tokens
            length = next((i for i, (a, b) in enumerate(zip(held, wanted)) if a != b), min(len(held), len(wanted)))
            if length > matched:
                best, matched = page, length
        if best is None:
            return 0
        # the copy runs before the step writes anything, so the source may even be reused by this step; only
        # the matched tokens are copied (a fresh page faults in only what is written)
        target = self._allocate()
        self.pending_copies.append((best, target, matched))
        seq.block_table.append(target)
        return matched

    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Make `seq` own pages for its first `num_tokens` tokens, copying a shared page it will write."""
        if self._needs_copy(seq, num_tokens):
            old = seq.block_table[-1]
            new = self._allocate()
            self.pending_copies.append((old, new, self.page_size))
            self._release(old)
            seq.block_table[-1] = new
        while len(seq.block_table) * self.page_size < num_tokens:
            seq.block_table.append(self._allocate())

    def register_pages(self, seq: Sequence) -> None:
        """After a step: put `seq`'s pages into the prefix cache: those now full of computed tokens as whole
        pages, the one being filled for partial matches (with the tokens it holds so far)."""
        if not self.enable_prefix_caching:
            return
        parent = seq.cache_salt
        for index in range(-(-seq.num_computed // self.page_size)):
            start = index * self.page_size
            number = seq.block_table[index]
            page = self._pages[number]
            if page.hash is not None:  # a whole page registered before: its key chains on
                parent = page.hash
                continue
            held = tuple(seq.token_ids[start:min(seq.num_computed, start + self.page_size)])
            if page.tokens != held:
                if page.tokens is None or page.parent != parent or page.tokens[0] != held[0]:
                    self._unregister(number)
                    page.parent = parent
                    self._after.setdefault((parent, held[0]), set()).add(number)
                page.tokens = held
            if len(held) < self.page_size:
                break
            key = self._hash(parent, seq.token_ids, index)
            if page.hash is None:
                page.hash = key
                self._by_hash.setdefault(key, number)
            parent = key

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every page of `parent` (a later write into a shared page copies it first)."""
        child.block_table = list(parent.block_table)
        child.num_computed = parent.num_computed
        for page in child.block_table:
            self._pages[page].ref_count += 1

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s pages; unshared ones return to the free queue (keeping their cached contents)."""
        # a copy into a page it no longer owns must not land on whoever takes that page next
        dropped = set(seq.block_table)
        self.pending_copies = [copy for copy in self.pending_copies if copy[1] not in dropped]
        for page in reversed(seq.block_table):
            self._release(page)
        seq.block_table = []
        seq.num_computed = 0

    def reset_prefix_cache(self) -> None:
        """Forget the contents of every page no sequence holds (measurements that must start cold)."""
        for index, page in enumerate(self._pages):
            if page.ref_count == 0 and page.tokens is not None:
                self._unregister(index)
                if index in self._cached:
                    del self._cached[index]
                    self._blank[index] = None

    def _hash(self, parent: int | None, tokens: list[int], index: int) -> int:
        return hash((parent, tuple(tokens[index * self.page_size:(index + 1) * self.page_size])))

    def _needs_copy(self, seq: Sequence, num_tokens: int) -> bool:
        if not seq.block_table or num_tokens <= seq.num_computed:
            return False
        last = seq.num_computed // self.page_size
        return last < len(seq.block_table) and self._pages[seq.block_table[last]].ref_count > 1

    def _take(self, page: int) -> None:
        if self._pages[page].ref_count == 0:
            del self._cached[page]
            self.peak_used = max(self.peak_used, self.num_used)
        self._pages[page].ref_count += 1

    def _allocate(self) -> int:
        if self._blank:
            page, _ = self._blank.popitem()
        elif self._cached:
            page, _ = self._cached.popitem(last=False)
        else:
            raise RuntimeError("no free KV page: the scheduler must check can_hold first")
        self._unregister(page)
        entry = self._pages[page]
        entry.ref_count = 1
        if not entry.written:
            entry.written = True
            self.touched += 1
        self.peak_used = max(self.peak_used, self.num_used)
        return page

    def _release(self, page: int) -> None:
        entry = self._pages[page]
        entry.ref_count -= 1
        if entry.ref_count == 0:
            (self._cached if entry.tokens is not None else self._blank)[page] = None

    def _unregister(self, page: int) -> None:
        """Forget what `page` holds: it is about to hold something else."""
        entry = self._pages[page]
        if entry.hash is not None and self._by_hash.get(entry.hash) == page:
            del self._by_hash[entry.hash]
        if entry.tokens is not None:
            after = self._after.get((entry.parent, entry.tokens[0]))
            if after is not None:
                after.discard(page)
                if not after:
                    del self._after[(entry.parent, entry.tokens[0])]
        entry.hash, entry.parent, entry.tokens = None, None, None
