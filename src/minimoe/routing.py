"""The `Routing` value: the [T, k] expert choices sorted once, which every dispatch kernel
then walks.

`flatten_sort_count` returns a `Routing`: the sorted ids, the slot of each sorted row, the
experts' end offsets, k and E, validated once when it is made. Kernels and launchers trust
a Routing; hand-built index tensors become one through `Routing.from_indices`, which checks
them. Either way the check costs one device→host copy of a small summary (a few flags and
the E offsets), kept on the Routing as `ends`, so no later launch needs to sync.

`expert_tiles` cuts the sorted rows into the row tiles of the scatter2scatter kernel; a
Routing keeps them per tile size (`Routing.tiles`), so the forward and the backward's dX
launch on one routing cut them once.

The routers, which choose the experts, are in `routers.py`.
"""

from __future__ import annotations

import torch


class Routing:
    """The sorted routing of T tokens to k of E experts each (M = T·k slots, slot s = t·k + j).

    sorted_expert_idxs [M] int64: non-decreasing expert ids (sorted row i goes to expert
    sorted_expert_idxs[i]); sorted_scattered_idxs [M] int64: a permutation of 0..M-1, the slot
    of sorted row i (its token is slot // k); expert_offsets [E] int64: inclusive cumulative
    counts, i.e. expert e owns sorted rows offsets[e-1]..offsets[e] (offsets[-1] read as 0);
    k, n_experts: ints; ends: expert_offsets as a tuple of Python ints (host copy);
    `tiles(block_m)`: the kernel's row tiles, cut once per tile size.

    It unpacks as the three tensors: `sei, ssi, offsets = flatten_sort_count(...)`.
    """

    __slots__ = ("sorted_expert_idxs", "sorted_scattered_idxs", "expert_offsets", "k",
                 "n_experts", "ends", "_tiles")

    def __init__(self, sorted_expert_idxs: torch.Tensor, sorted_scattered_idxs: torch.Tensor,
                 expert_offsets: torch.Tensor, k: int, n_experts: int):
        """Validate hand-built indices (see `from_indices`): ValueError naming the argument."""
        sei, ssi, offs = _check_static(sorted_expert_idxs, sorted_scattered_idxs,
                                       expert_offsets, k, n_experts)
        M = sei.shape[0]
        flags = {                                      # all on the device: no sync yet
            "sorted_expert_idxs range": _all_in(sei, 0, n_experts),
            "sorted_expert_idxs order": (sei[1:] >= sei[:-1]).all(),
            "sorted_scattered_idxs": _is_permutation(ssi),
            # The end row of expert e is the number of sorted ids <= e (ids sorted).
            "expert_offsets": (offs == torch.searchsorted(
                sei, torch.arange(n_experts, device=sei.device), right=True)).all(),
        }
        summary = torch.cat([torch.stack(list(flags.values())).long(), offs]).tolist()  # 1 sync
        ok, ends = summary[:len(flags)], tuple(summary[len(flags):])
        bad = [name for name, good in zip(flags, ok, strict=True) if not good]
        if bad:
            raise ValueError(_explain(bad[0], sei, ssi, offs, M, n_experts))
        self._set(sei, ssi, offs, k, n_experts, ends)

    @classmethod
    def from_indices(cls, sorted_expert_idxs: torch.Tensor, sorted_scattered_idxs: torch.Tensor,
                     expert_offsets: torch.Tensor, k: int, n_experts: int) -> Routing:
        """A Routing from hand-built indices, checked: integer 1-D tensors on one device of
        shapes [M], [M], [E] with M divisible by k and 1 <= k <= E; sorted ids non-decreasing
        in 0..E-1; scattered ids a permutation of 0..M-1; offsets == cumsum(bincount(ids, E)).
        One host sync."""
        return cls(sorted_expert_idxs, sorted_scattered_idxs, expert_offsets, k, n_experts)

    @classmethod
    def _trusted(cls, sei, ssi, offs, k: int, n_experts: int, ends: tuple[int, ...]) -> Routing:
        """Built from parts already known consistent (no check, no sync)."""
        routing = cls.__new__(cls)
        routing._set(sei, ssi, offs, k, n_experts, ends)
        return routing

    def _set(self, sei, ssi, offs, k, n_experts, ends) -> None:
        self.sorted_expert_idxs, self.sorted_scattered_idxs, self.expert_offsets = sei, ssi, offs
        self.k, self.n_experts, self.ends = k, n_experts, ends
        self._tiles: dict[int, tuple] = {}           # block_m -> (start, end): see tiles()

    @property
    def n_rows(self) -> int:
        """M = T·k, the number of routing slots (sorted rows)."""
        return self.sorted_expert_idxs.shape[0]

    @property
    def n_tokens(self) -> int:
        return self.n_rows // self.k

    def tiles(self, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`expert_tiles` of these sorted rows for tiles of block_m: (start, end) int64
        [n_tiles], cut at the first call for each block_m and kept (device ops, no sync).
        Every launch on this routing reuses them; `with_k` shares them (same rows)."""
        if block_m not in self._tiles:
            self._tiles[block_m] = expert_tiles(self.sorted_expert_idxs, self.n_experts, block_m)
        return self._tiles[block_m]

    def counts(self) -> list[int]:
        """Rows per expert [E] (from the host copy of the offsets: no sync)."""
        return [end - start for start, end in zip((0, *self.ends[:-1]), self.ends, strict=True)]

    def active_experts(self) -> list[int]:
        """Ids of the experts with at least one row, ascending (no sync)."""
        return [e for e, n in enumerate(self.counts()) if n]

    def compacted(self) -> tuple[list[int], Routing]:
        """(active experts, this routing over them alone): the n active experts renumbered
        0..n-1 in order, so the sorted order and the scattered ids stay as they are. No sync:
        the active experts come from the host copy of the offsets."""
        active = self.active_experts()
        dev = self.sorted_expert_idxs.device
        ids = torch.tensor(active, dtype=torch.int64, device=dev)                # [n]
        remap = torch.full((self.n_experts,), -1, dtype=torch.int64, device=dev)
        remap[ids] = torch.arange(len(active), device=dev)
        return active, Routing._trusted(remap[self.sorted_expert_idxs], self.sorted_scattered_idxs,
                                        self.expert_offsets[ids], self.k, len(active),
                                        tuple(self.ends[e] for e in active))

    def with_k(self, k: int) -> Routing:
        """The same sorted rows read with k slots per token (ScatterMoE passes k=1 to a grouped
        output projection and takes top-k from the gates)."""
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.n_experts \
                or self.n_rows % k:
            raise ValueError(f"k must be in 1..{self.n_experts} and divide the {self.n_rows} "
                             f"rows, got {k!r}")
        routing = Routing._trusted(self.sorted_expert_idxs, self.sorted_scattered_idxs,
                                   self.expert_offsets, k, self.n_experts, self.ends)
        routing._tiles = self._tiles                       # k does not change the tiles
        return routing

    def __iter__(self):
        return iter((self.sorted_expert_idxs, self.sorted_scattered_idxs, self.expert_offsets))

    def __len__(self) -> int:
        return 3

    def __getitem__(self, i):
        return (self.sorted_expert_idxs, self.sorted_scattered_idxs, self.expert_offsets)[i]

    def __repr__(self) -> str:
        return (f"Routing(T={self.n_tokens}, k={self.k}, n_experts={self.n_experts}, "
                f"rows per expert={self.counts()})")


def flatten_sort_count(expert_idxs: torch.Tensor, num_experts: int) -> Routing:
    """expert_idxs [T, k] -> Routing (sorted_expert_idxs [T·k], sorted_scattered_idxs [T·k],
    expert_offsets [E], k, E); it unpacks as the three tensors.

    Flatten the choices in slot order (slot s = t·k + j), sort them stably by expert:
    `sorted_scattered_idxs[i]` is the slot of sorted row i (its token is slot // k), and
    `expert_offsets[e]` the inclusive cumulative count, i.e. the end row of expert e (its
    rows are offsets[e-1]..offsets[e], with offsets[-1] read as 0). int64 throughout.
    Consistent by construction; the ids' range is checked with one host sync.
    """
    if not isinstance(expert_idxs, torch.Tensor) or expert_idxs.dim() != 2:
        raise ValueError(f"expert_idxs must be a [tokens, k] tensor, got "
                         f"{tuple(getattr(expert_idxs, 'shape', ()))}")
    if expert_idxs.dtype.is_floating_point or expert_idxs.dtype.is_complex \
            or expert_idxs.dtype == torch.bool:
        raise ValueError(f"expert_idxs must be an integer tensor, got {expert_idxs.dtype}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    k = expert_idxs.shape[1]
    if not 1 <= k <= num_experts:
        raise ValueError(f"expert_idxs has k={k} columns; k must be in 1..{num_experts}")
    flat = expert_idxs.reshape(-1).long()                                  # [T·k]
    sorted_expert_idxs, sorted_scattered_idxs = flat.sort(stable=True)      # [T·k] each
    offsets = torch.searchsorted(sorted_expert_idxs,
                                 torch.arange(num_experts, device=flat.device), right=True)
    summary = torch.cat([_all_in(flat, 0, num_experts).long().reshape(1), offsets]).tolist()
    if not summary[0]:
        raise ValueError(f"expert_idxs must lie in 0..{num_experts - 1}, got "
                         f"{int(flat.min())}..{int(flat.max())}")
    return Routing._trusted(sorted_expert_idxs, sorted_scattered_idxs, offsets, k, num_experts,
                            tuple(summary[1:]))


def expert_tiles(sorted_expert_idxs: torch.Tensor, E: int, block_m: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut each expert's sorted rows into tiles of block_m: (start, end) int64 [n_tiles].

    Tile t covers rows start[t] .. min(start[t] + block_m, end[t]) of one expert, end[t]
    being that expert's end row; n_tiles = cdiv(M, block_m) + min(E, M) - 1 bounds the
    tiles any routing needs (each expert with rows adds at most one partial tile), and the
    spare ones have start == end == 0. Device ops only, no host sync. M >= 1.
    """
    sei = sorted_expert_idxs
    M = sei.shape[0]
    experts = torch.arange(E, device=sei.device)
    ends = torch.searchsorted(sei, experts, right=True)                    # [E] end rows
    counts = torch.diff(ends, prepend=ends.new_zeros(1))                   # [E] rows each
    tiles = (counts + block_m - 1) // block_m                              # [E] tiles each
    last_tile = torch.cumsum(tiles, 0)                                     # [E] exclusive
    t = torch.arange(-(-M // block_m) + min(E, M) - 1, device=sei.device)
    e = torch.searchsorted(last_tile, t, right=True)                       # [n_tiles]
    used = e < E
    e = e.clamp(max=E - 1)
    start = ends[e] - counts[e] + (t - (last_tile[e] - tiles[e])) * block_m
    zero = start.new_zeros(())
    return torch.where(used, start, zero), torch.where(used, ends[e], zero)


def _all_in(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """0-d bool on t's device: every value of t in lo..hi-1 (true when t is empty)."""
    return ((t >= lo) & (t < hi)).all()


def _is_permutation(t: torch.Tensor) -> torch.Tensor:
    """0-d bool on t's device: t [M] holds each of 0..M-1 exactly once."""
    M = t.shape[0]
    hits = torch.zeros(M, dtype=torch.int64, device=t.device)
    hits.scatter_add_(0, t.clamp(0, max(M - 1, 0)), torch.ones_like(t))    # [M]
    return _all_in(t, 0, M) & (hits == 1).all()


def _check_static(sei, ssi, offs, k, n_experts):
    """Types, dtypes, shapes and devices (no sync) -> the three as contiguous int64."""
    for t, name in ((sei, "sorted_expert_idxs"), (ssi, "sorted_scattered_idxs"),
                    (offs, "expert_offsets")):
        if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype.is_complex \
                or t.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
        if t.device != sei.device:
            raise ValueError(f"{name} is on {t.device}, sorted_expert_idxs on {sei.device}")
    if isinstance(n_experts, bool) or not isinstance(n_experts, int) or n_experts < 1:
        raise ValueError(f"n_experts must be an int >= 1, got {n_experts!r}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n_experts:
        raise ValueError(f"k must be an int in 1..{n_experts} (the number of experts), got {k!r}")
    M = sei.shape[0]
    if ssi.shape[0] != M:
        raise ValueError(f"sorted_scattered_idxs must have shape [{M}] like sorted_expert_idxs, "
                         f"got {tuple(ssi.shape)}")
    if M % k:
        raise ValueError(f"sorted_expert_idxs has {M} rows, not a multiple of k={k}")
    if offs.shape[0] != n_experts:
        raise ValueError(f"expert_offsets must have shape [{n_experts}] (E), "
                         f"got {tuple(offs.shape)}")
    return (t.long().contiguous() for t in (sei, ssi, offs))


def _explain(failed: str, sei, ssi, offs, M: int, E: int) -> str:
    """The message for the first failed check (error path only: syncs freely)."""
    if failed == "sorted_expert_idxs range":
        return (f"sorted_expert_idxs must lie in 0..{E - 1}, got "
                f"{int(sei.min())}..{int(sei.max())}")
    if failed == "sorted_expert_idxs order":
        i = int((sei[1:] < sei[:-1]).nonzero()[0])
        return (f"sorted_expert_idxs must be non-decreasing (sorted by expert), but row {i + 1} "
                f"({int(sei[i + 1])}) follows {int(sei[i])}")
    if failed == "sorted_scattered_idxs":
        return (f"sorted_scattered_idxs must be a permutation of 0..{M - 1} (each slot once), "
                f"got {ssi.tolist() if M <= 16 else 'repeated or out-of-range slots'}")
    want = torch.bincount(sei, minlength=E).cumsum(0)
    return (f"expert_offsets must be the inclusive cumulative counts of sorted_expert_idxs "
            f"(cumsum(bincount(ids, E)) = {want.tolist()}), got {offs.tolist()}")
