"""Prefix cache: a radix tree whose edges are whole KV pages of tokens, with LRU eviction.

Each node is one full page: `key` its `page_size` token ids, `page` the KV page holding them. The
tree holds one reference on each node's page (and on its GDN checkpoint slot), so a page stays
alive while the tree or any running sequence uses it. For hybrid models a node may also hold a
checkpoint slot: the GDN conv/recurrent state after the node's last token. Since a GDN state
cannot be rebuilt from KV, a hit on a hybrid model is cut back to the deepest matched node that
holds a checkpoint.

Eviction is LRU: a leaf whose page only the tree references can go (its page returns to the pool);
checkpoint slots only the tree references can be dropped from any node.
"""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

from nvl72.cache.pool import RefPool


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]
    page: int
    parent: "_Node | None"
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)
    last_access: int = 0
    slot: int = -1  # GDN checkpoint slot, -1: none
    depth: int = 0  # pages from the root


@dataclass
class PrefixMatch:
    pages: list[int]  # one reference taken on each for the caller
    num_tokens: int
    slot: int = -1  # checkpoint slot at num_tokens (one reference taken), -1: none


class PrefixCache:
    def __init__(self, page_size: int, pages: RefPool, slots: RefPool | None = None, *, hybrid: bool = False,
                 enabled: bool = True):
        if page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
        self.page_size = page_size
        self.pages = pages
        self.slots = slots
        self.hybrid = hybrid
        self.enabled = enabled
        self.root = _Node((), -1, None)
        self._clock = itertools.count(1)
        self.num_nodes = 0
        # Nodes holding a checkpoint, least recently used first (slot eviction scans from here).
        self._ckpt: OrderedDict[_Node, None] = OrderedDict()

    def _keys(self, tokens: list[int], num_pages: int):
        p = self.page_size
        for i in range(num_pages):
            yield tuple(tokens[i * p:(i + 1) * p])

    def match(self, tokens: list[int]) -> PrefixMatch:
        """Longest cached prefix of `tokens` in whole pages (cut to a checkpoint on hybrid models).

        The caller owns one reference on every returned page and on the returned slot."""
        if not self.enabled:
            return PrefixMatch([], 0)
        now = next(self._clock)
        node, path = self.root, []
        for key in self._keys(tokens, len(tokens) // self.page_size):
            node = node.children.get(key)
            if node is None:
                break
            node.last_access = now
            if node.slot >= 0:
                self._ckpt.move_to_end(node)
            path.append(node)
        if self.hybrid:
            while path and path[-1].slot < 0:
                path.pop()
        for n in path:
            self.pages.incref(n.page)
        slot = -1
        if self.hybrid and path:
            slot = path[-1].slot
            self.slots.incref(slot)
        return PrefixMatch([n.page for n in path], len(path) * self.page_size, slot)

    def insert(self, tokens: list[int], pages: list[int], checkpoints: dict[int, int] | None = None,
               cursor: "_Node | None" = None, num_tokens: int | None = None) -> "_Node | None":
        """Record the full pages of `tokens[:num_tokens]` (KV in `pages`); `checkpoints` maps a page index to the
        slot holding the GDN state after that page's last token (a function of the tokens only). The
        tree takes its own references; where it already holds the same tokens it keeps its page.

        `cursor`, the value a previous insert of a prefix of `tokens` returned, lets the walk start
        where that one ended (a growing sequence inserts each new page once, not its whole path)."""
        if not self.enabled:
            return None
        checkpoints = checkpoints or {}
        now = next(self._clock)
        node = cursor if cursor is not None and self._attached(cursor) else self.root
        p = self.page_size
        n = len(tokens) if num_tokens is None else min(num_tokens, len(tokens))
        for i in range(node.depth, min(n // p, len(pages))):
            key = tuple(tokens[i * p:(i + 1) * p])
            child = node.children.get(key)
            if child is None:
                child = _Node(key, pages[i], node, depth=i + 1)
                self.pages.incref(pages[i])
                self.pages.tag(pages[i])
                node.children[key] = child
                self.num_nodes += 1
            child.last_access = now
            slot = checkpoints.get(i, -1)
            if self.hybrid and slot >= 0 and child.slot < 0:
                child.slot = slot
                self.slots.incref(slot)
                self._ckpt[child] = None
            if child.slot >= 0:
                self._ckpt.move_to_end(child)
            node = child
        return node

    def _attached(self, n: _Node) -> bool:
        return n is self.root or n.parent is not None

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def num_evictable_pages(self) -> int:
        """Pages only the tree references (a running sequence holds its whole prefix, so every
        such node can go once its descendants have)."""
        return self.pages.num_tagged_only

    def evict_pages(self, num_pages: int) -> int:
        """Drop least-recently-used leaves that only the tree references until `num_pages` pages
        have been returned to the pool (or nothing more can go). Returns the number freed."""
        heap = [(n.last_access, id(n), n) for n in self._nodes()
                if not n.children and self.pages.refcount(n.page) == 1]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, n = heapq.heappop(heap)
            parent = n.parent
            self._drop(n)
            freed += 1
            if parent is not self.root and not parent.children and self.pages.refcount(parent.page) == 1:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def evict_slots(self, num_slots: int) -> int:
        """Drop least-recently-used checkpoint slots that only the tree references; among equally
        recent ones the shallower first (a deeper checkpoint on the same path serves longer hits)."""
        if not self.hybrid:
            return 0
        victims = []
        for n in self._ckpt:  # oldest first; skips the few a running sequence still reads
            if len(victims) == num_slots:
                break
            if self.slots.refcount(n.slot) == 1:
                victims.append(n)
        for n in victims:
            del self._ckpt[n]
            self.slots.decref(n.slot)
            n.slot = -1
        return len(victims)

    def _drop(self, n: _Node) -> None:
        del n.parent.children[n.key]
        n.parent = None  # detached: a cursor pointing here is stale
        self.pages.untag(n.page)
        self.pages.decref(n.page)
        if n.slot >= 0:
            del self._ckpt[n]
            self.slots.decref(n.slot)
        self.num_nodes -= 1

    def clear(self) -> None:
        """Release every reference the tree holds."""
        for n in list(self._nodes()):
            n.parent = None
            self.pages.untag(n.page)
            self.pages.decref(n.page)
            if n.slot >= 0:
                self.slots.decref(n.slot)
        self.root.children.clear()
        self._ckpt.clear()
        self.num_nodes = 0
