"""Rows that share a prefix compute it once: the rollout's first feed (a group's G episodes start from one prompt)
and the update's forward (a group's samples share their prompt) both group rows by common prefixes (pure Python, no
torch)."""

from __future__ import annotations

from collections.abc import Sequence


def shared_prefixes(blocks: Sequence[Sequence[int]], min_shared: int = 8) -> tuple[list[int], list[int]] | None:
    """Group rows whose blocks share a prefix of at least ``min_shared`` tokens, so as to compute the most once.

    Rows are sorted by their ids, so that rows with long common prefixes are neighbours; a cluster is a run of
    neighbours, its shared length the shortest common prefix inside the run, and it saves (rows − 1) × shared length.
    A run is split where that saves more: two tasks' prompts share a system prompt, but each task's G rows share far
    more (the whole task prompt), so ``[system + A] × 4, [system + B] × 4`` becomes two clusters, not one.  A row alone
    is its own cluster (its whole block).  Returns (``cluster_of`` [B]: each row's cluster, numbered in order of
    first appearance; ``cut`` [B]: how many leading tokens of the row come from its cluster's shared prefix), or None
    when sharing would save fewer than ``min_shared`` token computations."""
    n = len(blocks)
    order, lcp = _sorted_neighbours(blocks)

    def best() -> tuple[int, list[tuple[int, int, int]]]:
        """Most tokens saved by splitting the sorted rows into runs, and those runs (first, last, shared): each span
        lo..hi is split at its weakest link, or kept whole where that saves more.  Iterative (a chain of n rows
        nests n spans deep)."""
        done: dict[tuple[int, int], tuple[int, list[tuple[int, int, int]]]] = {}
        todo = [(0, n - 1, False)]
        while todo:
            lo, hi, split_done = todo.pop()
            if lo == hi:
                done[lo, hi] = (0, [(lo, hi, len(blocks[order[lo]]))])
                continue
            k = min(range(lo, hi), key=lambda j: lcp[j])  # the weakest link
            if not split_done:
                todo += [(lo, hi, True), (lo, k, False), (k + 1, hi, False)]
                continue
            (s_left, left), (s_right, right) = done.pop((lo, k)), done.pop((k + 1, hi))
            split = s_left + s_right, left + right
            whole = (hi - lo) * lcp[k]
            done[lo, hi] = ((whole, [(lo, hi, lcp[k])]) if lcp[k] >= min_shared and whole >= split[0] else split)
        return done[0, n - 1]

    saved, runs = best() if n else (0, [])
    if saved < min_shared:
        return None
    run_of, shared = {}, []
    for r, (lo, hi, k) in enumerate(runs):
        shared.append(k)
        for j in range(lo, hi + 1):
            run_of[order[j]] = r
    number: dict[int, int] = {}
    cluster_of = [number.setdefault(run_of[i], len(number)) for i in range(n)]
    cut = [shared[run_of[i]] for i in range(n)]
    return cluster_of, cut


def cluster_heads(cluster_of: Sequence[int]) -> list[int]:
    """The first row of each cluster of :func:`shared_prefixes`, in cluster order (clusters are numbered by first
    appearance): the rows whose prefix is computed for the cluster."""
    heads: dict[int, int] = {}
    for row, c in enumerate(cluster_of):
        heads.setdefault(c, row)
    return [heads[c] for c in range(len(heads))]


def _sorted_neighbours(blocks: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """The rows sorted by their ids ``[n]``, and the common prefix of each pair of neighbours in that order
    ``[n-1]``."""
    order = sorted(range(len(blocks)), key=lambda i: tuple(blocks[i]))
    return order, [common_prefix(blocks[a], blocks[b]) for a, b in zip(order, order[1:])]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k


def microbatch_runs(lengths: Sequence[int], size: int, max_tokens: int | None = None) -> list[tuple[int, int]]:
    """A step's micro-batches as runs ``(start, stop)`` of consecutive rows.  Each run has at most ``size`` rows and,
    with ``max_tokens``, at most that many fed positions (rows × the longest row).  A longer row goes alone."""
    out, start, width = [], 0, 0
    for row, n in enumerate(lengths):
        full = row - start >= size or (max_tokens is not None and (row - start + 1) * max(width, n) > max_tokens)
        if row > start and full:
            out.append((start, row))
            start, width = row, 0
        width = max(width, n)
    if lengths:
        out.append((start, len(lengths)))
    return out


def fed_positions(blocks: Sequence[Sequence[int]], min_shared: int = 8) -> int:
    """Positions the shared-prefix forward (``scoring.shared_prefix_hidden``) feeds for one micro-batch of rows.
    That is the C distinct prefixes padded to the longest, then every row's rest padded to the longest rest.  When
    nothing is shared: the rows whole, padded."""
    plan = shared_prefixes(blocks, min_shared)
    if plan is None:
        return len(blocks) * max(map(len, blocks), default=0)
    cluster_of, cut = plan
    heads = cluster_heads(cluster_of)
    rest = max(len(b) - k for b, k in zip(blocks, cut))
    return len(heads) * max(cut[i] for i in heads) + (len(blocks) * rest if rest else 0)


def shared_prefix_order(blocks: Sequence[Sequence[int]], size: int, max_tokens: int | None = None,
                        min_shared: int = 8) -> list[int]:
    """An order of the rows for the shared-prefix update: of a few candidates, the one whose micro-batches feed the
    fewest positions.  Micro-batches are :func:`microbatch_runs`, each costs :func:`fed_positions`.

    The candidates: the rows as given (kept on a tie), and the rows sorted by their ids, so that rows with long
    common prefixes are neighbours.  Sorted so, a micro-batch mixes lengths: in ``two_call`` an episode's prompts grow
    step by step, so its rows share much and pad much.  So the others cut the sorted rows into families at the
    weakest links between neighbours.  They make at most 1, 3, 7, … cuts (ties make fewer), and sort each family
    longest first.  A micro-batch then tends to hold rows of one family and of similar length.  Returns row
    indices."""
    n = len(blocks)
    given = list(range(n))
    if n <= 2:
        return given
    ids, links = _sorted_neighbours(blocks)
    weakest = sorted(links)
    candidates, seen = [given, ids], set()
    k = 1
    while k < n:
        least = weakest[min(k, n - 2)]  # families: runs joined by links of at least this many tokens
        if least not in seen:
            seen.add(least)
            families, family = [], [ids[0]]
            for row, link in zip(ids[1:], links):
                if link < least:
                    families.append(family)
                    family = []
                family.append(row)
            families.append(family)
            candidates.append([i for f in families for i in sorted(f, key=lambda i: (-len(blocks[i]), blocks[i]))])
        k = 2 * k + 1

    def cost(order: list[int]) -> int:
        lengths = [len(blocks[i]) for i in order]
        return sum(fed_positions([blocks[i] for i in order[a:b]], min_shared)
                   for a, b in microbatch_runs(lengths, size, max_tokens))

    return min(candidates, key=cost)
