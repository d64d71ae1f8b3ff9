"""Which units (sequences; pairs of sequences for preference data) form each optimizer step, from a mixture of sources.

The global batch is the unit of data order: optimizer step s reads a global batch of G units fixed by the seed, the
step and the mixture (its sources and weights) alone. Ranks and micro-steps only split it: micro-step m of rank r
takes units [(m*W + r)*B, (m*W + r + 1)*B) of it (W ranks, micro batch B). So a run resumed on another number of
ranks reads exactly what an uninterrupted one reads.

Each source is read in epochs: epoch e of source i is a permutation of its units seeded by (seed, i, e), drawn in
order; a source that runs out starts its next epoch while the others go on. Every unit is read once per epoch of its
source.

The mixture: each of the G slots of a step goes to the source that is furthest behind its weight, the weighted
fair queueing rule: the source with the smallest (drawn_i + cost of its next unit) / w_i, where drawn_i is what it
has contributed so far and the cost is the unit's loss-carrying tokens (data.mix_by: tokens) or 1 (rows). So at
every point of the run each source's share of what was drawn is within one unit of its weight, and over any window
of steps within two units: e.g. 100 steps of 32 sequences of up to 512 tokens, a share within 1,024 tokens of its
weight out of ~1.6M.

The order is computed step after step; the sampler's state (per source: units drawn, what they cost) is a handful of
integers, saved in every checkpoint and restored on resume. Memory per rank: that state, and the per-unit costs the
data already memory-maps (uint32 per sequence). The permutations are Feistel networks, computed per unit in O(1)
memory: no list of indices, whatever the size of the data. This module imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from accel_fsdp.config.recipe import TrainingConfig

_M64 = (1 << 64) - 1


def mix64(z: int) -> int:
    """SplitMix64's finalizer: a 64-bit integer hash (Steele, Lea and Flood, 2014)."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _mix64_array(z: np.ndarray) -> np.ndarray:
    """mix64 of every element (uint64; numpy wraps multiplication modulo 2**64)."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class Permutation:
    """A seeded bijection of range(n) in O(1) memory: a balanced Feistel network on the smallest even number of bits
    that covers n, with cycle walking (a value outside range(n) is enciphered again until it falls inside; the
    domain is below 4n, so fewer than 4 rounds of walking on average)."""

    ROUNDS = 6

    def __init__(self, n: int, key: int):
        assert n >= 1, n
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self.n, self.half, self.low = n, bits // 2, (1 << (bits // 2)) - 1
        self.keys = [mix64((key * self.ROUNDS + r) & _M64) for r in range(self.ROUNDS)]

    def __call__(self, i: int) -> int:
        assert 0 <= i < self.n, (i, self.n)
        x = i
        while True:
            left, right = x >> self.half, x & self.low
            for k in self.keys:
                left, right = right, left ^ (mix64(right ^ k) & self.low)
            x = (left << self.half) | right
            if x < self.n:
                return x

    def many(self, indices: np.ndarray) -> np.ndarray:
        """The images of an array of indices (vectorized; the same values as calling one by one)."""
        x = np.asarray(indices, dtype=np.uint64).copy()
        todo = np.ones(len(x), bool)
        half, low = np.uint64(self.half), np.uint64(self.low)
        while todo.any():
            y = x[todo]
            left, right = y >> half, y & low
            for k in self.keys:
                left, right = right, left ^ (_mix64_array(right ^ np.uint64(k)) & low)
            x[todo] = (left << half) | right
            todo &= x >= np.uint64(self.n)
        return x.astype(np.int64)


def held_out(n: int, fraction: float, seed: int, salt: int = 0) -> tuple[int, Permutation | None]:
    """The held-out split of n rows: (how many, the permutation that picks them: row i is held out when
    perm(i) < how many). round(n x fraction) rows, at least 1 and at most n - 1 when the fraction is above 0."""
    if fraction <= 0 or n < 2:
        return 0, None
    count = min(n - 1, max(1, round(n * fraction)))
    return count, Permutation(n, mix64(seed) ^ mix64(0x5EED + salt))


class GlobalBatchSampler:
    """The global batch of every optimizer step, drawn from weighted sources (see the module docstring).

    `sizes[i]`: units of source i; `costs[i]`: what unit j of it weighs in the mixture (`costs[i][j]`: loss-carrying
    tokens), or None to count units (data.mix_by: rows). Unit ids are flat over the sources: source i's unit j is
    `offsets[i] + j`."""

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], costs: Sequence | None = None, *,
                 global_batch: int, micro_batch: int, world_size: int, rank: int, seed: int):
        assert len(sizes) == len(weights) and all(n >= 1 for n in sizes) and all(w > 0 for w in weights)
        self.sizes = [int(n) for n in sizes]
        total = math.fsum(weights)
        self.weights = [w / total for w in weights]
        self.costs = list(costs) if costs is not None else [None] * len(sizes)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.G, self.B, self.W, self.r, self.seed = global_batch, micro_batch, world_size, rank, seed
        batch = TrainingConfig(global_batch_size=global_batch, micro_batch_size=micro_batch)  # its formula, no copy
        self.accumulation_steps = batch.accumulation_steps(world_size)
        self._perms: dict[tuple[int, int], Permutation] = {}
        self._state = _State.start(len(sizes))
        self._step = 0
        self._restored: tuple[int, _State] | None = None
        self._cache: tuple[int, list[int], _State] | None = None

    @property
    def total_units(self) -> int:
        return int(self.offsets[-1])

    # -------------------------------------------------------------------------------------------- the order

    def unit(self, source: int, drawn: int) -> int:
        """The `drawn`-th unit source `source` hands out over the run (its epochs one after the other)."""
        epoch, index = divmod(drawn, self.sizes[source])
        key = (source, epoch)
        perm = self._perms.get(key)
        if perm is None:
            if len(self._perms) > 64:
                self._perms.clear()
            perm = self._perms[key] = Permutation(self.sizes[source], mix64(self.seed) ^ mix64((source << 32) + epoch))
        return perm(index)

    def cost(self, source: int, unit: int) -> int:
        costs = self.costs[source]
        return 1 if costs is None else int(costs[unit])

    def _draw(self, state: _State) -> tuple[list[int], _State]:
        """The global batch that follows `state`, and the state after it."""
        s = state.copy()
        ids = []
        k = len(self.sizes)
        for i in range(k):
            if s.next_unit[i] is None:
                s.next_unit[i] = self.unit(i, s.units[i])
                s.next_cost[i] = self.cost(i, s.next_unit[i])
        for _ in range(self.G):
            best = min(range(k), key=lambda i: ((s.drawn[i] + s.next_cost[i]) / self.weights[i], i))
            ids.append(int(self.offsets[best]) + s.next_unit[best])
            s.units[best] += 1
            s.drawn[best] += s.next_cost[best]
            s.next_unit[best] = self.unit(best, s.units[best])
            s.next_cost[best] = self.cost(best, s.next_unit[best])
        return ids, s

    def global_sequences(self, step: int) -> list[int]:
        """The unit ids of optimizer step `step`, in slot order (computed in order; an earlier step is replayed from
        the start, or from the restored checkpoint's step)."""
        if self._cache is not None and self._cache[0] == step:
            return self._cache[1]
        if self._cache is not None and self._cache[0] == step - 1:
            self._step, self._state = step, self._cache[2]
        if step < self._step:
            restart_here = self._restored is not None and self._restored[0] <= step
            self._step, self._state = ((self._restored[0], self._restored[1]) if restart_here
                                       else (0, _State.start(len(self.sizes))))
        while self._step < step:
            _, self._state = self._draw(self._state)
            self._step += 1
        ids, after = self._draw(self._state)
        self._cache = (step, ids, after)
        return ids

    def micro_batches(self, step: int) -> list[list[int]]:
        units = self.global_sequences(step)
        return [units[(m * self.W + self.r) * self.B:(m * self.W + self.r + 1) * self.B]
                for m in range(self.accumulation_steps)]

    def source_of(self, unit_id: int) -> int:
        return int(np.searchsorted(self.offsets, unit_id, side="right")) - 1

    def split(self, unit_id: int) -> tuple[int, int]:
        """(source, unit within it) of a flat unit id."""
        source = self.source_of(unit_id)
        return source, unit_id - int(self.offsets[source])

    # ----------------------------------------------------------------------------------------- checkpoints

    def state_dict(self, step: int) -> dict:
        """What a checkpoint after `step` optimizer steps saves: where each source stands (JSON-serializable)."""
        state = self._state_at(step)
        return {"step": step, "units": list(state.units), "drawn": list(state.drawn)}

    def _state_at(self, step: int) -> _State:
        """The state at the start of optimizer step `step`."""
        if self._cache is not None and self._cache[0] == step - 1:
            return self._cache[2]
        if self._step != step:
            self.global_sequences(step)
        return self._state

    def load_state_dict(self, saved: dict) -> None:
        """Continue after the saved step: the next `global_sequences` call is for step saved["step"]."""
        units, drawn = list(saved["units"]), list(saved["drawn"])
        if len(units) != len(self.sizes):
            raise ValueError(f"the saved data position has {len(units)} sources, this mixture {len(self.sizes)}")
        state = _State(units=units, drawn=drawn, next_unit=[None] * len(units), next_cost=[0] * len(units))
        self._step, self._state, self._cache = int(saved["step"]), state, None
        self._restored = (self._step, state.copy())

    def position(self, step: int) -> dict[str, int]:
        """Where the data stands after `step` steps, for trainer_state.json: the epoch of the whole mixture (units
        drawn / units of all sources), and units drawn since the start."""
        drawn = step * self.G
        return {"epoch": drawn // self.total_units, "batch_in_epoch": (drawn % self.total_units) // self.G,
                "rows_consumed": drawn}

    def epochs(self, steps: int, mean_costs: Sequence[float] | None = None) -> list[float]:
        """About how many epochs of each source `steps` optimizer steps read: the share of units each source gets
        (its weight, divided by its mean cost per unit when mixing by tokens), times the units read, over its size."""
        if mean_costs is None or all(c is None for c in self.costs):
            shares = self.weights
        else:
            raw = [w / max(c, 1e-9) for w, c in zip(self.weights, mean_costs)]
            shares = [r / math.fsum(raw) for r in raw]
        return [share * steps * self.G / n for share, n in zip(shares, self.sizes)]


class _State:
    """Per source: units handed out so far, their total cost, and the next unit with its cost (None: not drawn)."""

    __slots__ = ("units", "drawn", "next_unit", "next_cost")

    def __init__(self, units, drawn, next_unit, next_cost):
        self.units, self.drawn, self.next_unit, self.next_cost = units, drawn, next_unit, next_cost

    @classmethod
    def start(cls, k: int) -> _State:
        return cls([0] * k, [0] * k, [None] * k, [0] * k)

    def copy(self) -> _State:
        return _State(list(self.units), list(self.drawn), list(self.next_unit), list(self.next_cost))


def total_steps(recipe, units: int) -> int:
    """Optimizer steps of a run: training.max_steps, else training.epochs (default 1) passes over the units of all
    sources together, rounded up."""
    t = recipe.training
    if t.max_steps is not None:
        return t.max_steps
    return max(1, math.ceil((t.epochs if t.epochs is not None else 1.0) * units / t.global_batch_size))
