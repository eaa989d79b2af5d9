"""The in-process engine's draw: every row that samples in a lock step, drawn at once on the model's device.

Each row's restriction (a ``Choice``'s allowed continuations, a ``Free`` segment's banned tokens, top-k) becomes a
mask on the device — from a table of the step's distinct sets, kept across steps — then one batched draw uses the
seeded generator, log q and log π are gathered there, and one copy to the host brings back the step's tokens and
log-probs.  Drawn in row order from one generator, the tokens are those of drawing row by row (on CPU bit for bit).
log q is computed over the same sets as the trainer computes it (:func:`~sglightning.scoring.restricted_log_mass`;
for banned ids the allowed mass is summed directly, as the trainer does where it is small:
:func:`~sglightning.scoring.heavy_banned_mass`), so the two log-probs of a token agree to float rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sglightning.episodes import Restriction
from sglightning.scoring import listed_mask, restricted_log_mass


class RestrictionTable:
    """Restrictions as tensors on a device, kept across lock steps and sessions (a ``Free`` segment's banned set is
    the same thousands of ids at every step; a trie node's continuations recur in every group).  A step's whole
    table (its distinct sets in order) is kept too, within ``table_bytes``: writing freely, every step has the same
    one set, and rebuilding its masks cost a score of small device operations per step."""

    def __init__(self, limit: int = 4096, table_bytes: int = 64 << 20):
        self.limit = limit
        self.table_bytes = table_bytes
        self._ids: dict[tuple[Restriction, torch.device], torch.Tensor] = {}
        self._tables: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self._bytes = 0

    def ids(self, r: Restriction, device: torch.device) -> torch.Tensor:
        key = (r, device)
        t = self._ids.get(key)
        if t is None:
            if len(self._ids) >= self.limit:
                self._ids.clear()
            t = self._ids[key] = _h2d(r.ids, torch.long, device)  # [K] (once per set; no wait for the device)
        return t

    def stack(self, rs: Sequence[Restriction], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``rs`` as padded ``ids`` [U, K] and ``valid`` [U, K] (K = the longest)."""
        rows = [self.ids(r, device) for r in rs]
        ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # [U, K]
        k = torch.arange(ids.shape[1], device=device)  # [K]
        lens = _h2d([len(r.ids) for r in rs], torch.long, device)  # [U]
        return ids, k[None, :] < lens[:, None]

    def masks(self, rs: tuple[Restriction, ...], vocab: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """``rs`` as ``ids`` [U, K], ``valid`` [U, K], ``exclude`` [U] and ``allowed`` [U, V] (the tokens each set
        lets through), kept for the next step that meets the same sets."""
        key = (rs, vocab, device)
        out = self._tables.get(key)
        if out is not None:
            return out
        ids, valid = self.stack(rs, device)  # [U, K]
        exclude = _h2d([r.exclude for r in rs], torch.bool, device)  # [U]
        listed = listed_mask(ids, valid, vocab)  # [U, V]
        out = ids, valid, exclude, torch.where(exclude[:, None], ~listed, listed)
        size = sum(t.numel() * t.element_size() for t in out)
        if self._bytes + size > self.table_bytes:
            self._tables, self._bytes = {}, 0
        if size <= self.table_bytes:
            self._tables[key] = out
            self._bytes += size
        return out


def _h2d(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on ``device`` without a stream sync (pinned, asynchronous on CUDA)."""
    t = torch.tensor(values, dtype=dtype)
    return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)


def draw(logp: torch.Tensor, restrictions: Sequence[Restriction | None], top_k: int = 0, greedy: bool = False,
         generator: torch.Generator | None = None, table: RestrictionTable | None = None
         ) -> list[tuple[int, float, float, Restriction | None]]:
    """Sample one token per row of ``logp`` [R, V] (log-probabilities, already temperature-scaled), row r within
    ``restrictions[r]`` (None: the whole vocabulary) and the ``top_k`` most likely tokens (where not already a
    ``Choice``), drawing in row order from ``generator``.  One copy to the host at the end.

    Returns per row (token, log q of the distribution it was drawn from, unrestricted log π, the restriction that
    applied — top-k included — or None)."""
    R, V = logp.shape
    dev = logp.device
    table = table or RestrictionTable()

    def h2d(values, dtype) -> torch.Tensor:
        return _h2d(values, dtype, dev)

    neg_inf = torch.full((), float("-inf"), dtype=logp.dtype, device=dev)
    # the step's distinct restrictions as a table (as the trainer's collate builds it): ids [U, K], valid [U, K]
    uniq: dict[Restriction, int] = {}
    u_of = [-1 if r is None else uniq.setdefault(r, len(uniq)) for r in restrictions]
    allowed = None  # [R, V] bool, None = every row unrestricted
    mass_rows: list[int] = []  # rows whose log q needs log Z(A)
    if uniq:
        ids, valid, exclude, allowed_u = table.masks(tuple(uniq), V, dev)  # [U, K], [U, K], [U], [U, V]
        mass_rows = [i for i, u in enumerate(u_of) if u >= 0]
        every = len(mass_rows) == R  # every row restricted (the usual case: fewer operations)
        index = h2d(u_of if every else u_of + mass_rows, torch.long)  # one copy: [R] each row's set, [M] its rows
        rows_u = index[:R].clamp(min=0)  # [R]
        if every:
            allowed = allowed_u[0] if len(uniq) == 1 else allowed_u[rows_u]  # [V] (broadcast) or [R, V]
        else:
            allowed = allowed_u[rows_u] | (index[:R] < 0)[:, None]  # [R, V]
    scores = logp if allowed is None else torch.where(allowed, logp, neg_inf)  # [R, V]
    restricted = scores  # [R, V] before top-k
    topk_rows = [i for i, r in enumerate(restrictions) if r is None or r.exclude] if top_k else []
    top_idx = None
    if topk_rows:
        rows = h2d(topk_rows, torch.long)  # [T]
        vals, top_idx = scores[rows].topk(min(top_k, V), dim=-1)  # [T, k]
        top_ok = torch.isfinite(vals)  # [T, k] (fewer than k allowed tokens: the rest is -inf)
        keep = torch.zeros(len(topk_rows), V + 1, dtype=torch.bool, device=dev)  # [T, V+1]
        keep.scatter_(1, torch.where(top_ok, top_idx, V), True)
        scores = scores.index_copy(0, rows, torch.where(keep[:, :V], logp[rows], neg_inf))
        top_idx = torch.where(top_ok, top_idx, -1)  # [T, k]
    if greedy:
        tok = scores.argmax(dim=-1)  # [R]
    else:
        tok = torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator)[:, 0]  # [R]
    full = logp.gather(1, tok[:, None])[:, 0]  # [R] log π(y)
    logq = full
    if mass_rows or topk_rows:
        # log Z(A) of each row's set: listed ids (a Choice, top-k) or the complement of the listed ids (banned)
        if not mass_rows:
            log_z = torch.zeros(R, dtype=logp.dtype, device=dev)  # [R]
        elif every:
            sel = logp.gather(1, ids[rows_u])  # [R, K] log π of the listed ids
            log_z = restricted_log_mass(sel, valid[rows_u], exclude[rows_u])  # [R]
        else:
            m = index[R:]  # [M]
            u = rows_u[m]  # [M]
            sel = logp[m[:, None], ids[u]]  # [M, K] log π of the listed ids
            log_z = torch.zeros(R, dtype=logp.dtype, device=dev).index_copy(
                0, m, restricted_log_mass(sel, valid[u], exclude[u]))  # [R]
        if mass_rows and any(r is not None and r.exclude for r in restrictions):
            # banned ids: log Z(A) summed over A itself (log(1 − Σ banned) loses digits where the banned hold most)
            banned = exclude[rows_u] if every else exclude[rows_u] & (index[:R] >= 0)  # [R]
            log_z = torch.where(banned, torch.logsumexp(restricted, dim=-1), log_z)  # [R]
        if topk_rows:
            sel = logp[rows[:, None], top_idx.clamp(min=0)]  # [T, k]
            no = torch.zeros(len(topk_rows), dtype=torch.bool, device=dev)
            log_z = log_z.index_copy(0, rows, restricted_log_mass(sel, top_ok, no))
        logq = full - log_z  # [R] log q(y) = log π(y) − log Z(A)
    packed = torch.stack([tok.double(), logq, full], dim=1)  # [R, 3] float64 (ids exact; stacking promotes)
    host_top: dict[int, list[int]] = {}
    if topk_rows:
        top_host = top_idx.double()  # [T, k]
        packed = torch.cat([packed, torch.zeros(R, top_host.shape[1], dtype=torch.float64, device=dev)
                            .index_copy(0, rows, top_host)], dim=1)  # [R, 3 + k]
    values = packed.tolist()  # the one device-to-host copy of the step
    if topk_rows:
        for i in topk_rows:
            host_top[i] = sorted(int(t) for t in values[i][3:] if t >= 0)
    out = []
    for i, (r, row) in enumerate(zip(restrictions, values)):
        used = Restriction(tuple(host_top[i])) if i in host_top else r
        out.append((int(row[0]), row[1] if used is not None else row[2], row[2], used))
    return out
