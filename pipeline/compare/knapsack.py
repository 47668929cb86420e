"""Multiple-choice knapsack: one option per module, least total KL within a bit budget.

Each module offers options (stored bits, predicted KL). `allocate` picks one per module so
that the summed KL is least and the summed bits stay within the budget -- exactly, by
dynamic programming over bits in units of `unit` (each option's bits rounded *up*, so a
solution the table admits never exceeds the budget). `frontier` gives the best predicted KL
at every budget the table knows: the Pareto curve `qship tune` plots and searches.

A greedy pass by KL per bit (what `qship sensitivity --write-recipe` does) is optimal only
when a module has one upgrade; with several (4-bit g64, g32, 8-bit) it can buy a small
step on a module whose big step was the better use of the same bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Option:
    bits: int  # stored bits of the module's weight at this option
    kl: float  # predicted KL with the module at this option


@dataclass(frozen=True)
class Table:
    """The solved table: `best[c]` = least KL with at most c units above the cheapest
    options; `choice[i, c]` = the option module i takes in that solution."""

    unit: int
    floor_bits: int  # every module at its cheapest option
    best: np.ndarray
    choice: np.ndarray
    cost: tuple[tuple[int, ...], ...]  # units above the module's cheapest option

    def capacity(self, budget_bits: int) -> int:
        return min(len(self.best) - 1, (budget_bits - self.floor_bits) // self.unit)

    def pick(self, capacity: int) -> list[int]:
        """The option index of every module in the solution at `capacity` units."""
        out = []
        c = capacity
        for i in range(self.choice.shape[0] - 1, -1, -1):
            k = int(self.choice[i, c])
            out.append(k)
            c -= self.cost[i][k]
        return out[::-1]


def solve(modules: list[list[Option]], max_bits: int, unit: int) -> Table:
    """Solve for every budget up to `max_bits` (total stored bits) at resolution `unit`."""
    if not modules or any(not opts for opts in modules):
        raise ValueError("every module needs at least one option")
    floor_bits = sum(min(o.bits for o in opts) for opts in modules)
    cap = max(0, (max_bits - floor_bits) // unit)
    cost = tuple(
        tuple(math.ceil((o.bits - min(p.bits for p in opts)) / unit) for o in opts)
        for opts in modules
    )
    inf = np.inf
    # "at most c units": with no module yet KL is 0 at every capacity, so every row of the
    # table is non-increasing in c and the backtrack from any c is a valid solution
    best = np.zeros(cap + 1)
    choice: np.ndarray = np.zeros((len(modules), cap + 1), dtype=np.int16)
    for i, opts in enumerate(modules):
        new = np.full(cap + 1, inf)
        for k, o in enumerate(opts):
            w = cost[i][k]
            if w > cap:
                continue
            cand = np.full(cap + 1, inf)
            cand[w:] = best[: cap + 1 - w] + o.kl
            better = cand < new
            new[better] = cand[better]
            choice[i, better] = k
        best = new
    return Table(unit=unit, floor_bits=floor_bits, best=best, choice=choice, cost=cost)


def allocate(modules: list[list[Option]], budget_bits: int, unit: int) -> list[int]:
    """The option index per module with the least total KL within `budget_bits`."""
    t = solve(modules, budget_bits, unit)
    if budget_bits < t.floor_bits:
        raise ValueError(f"budget {budget_bits} bits is below the cheapest {t.floor_bits}")
    return t.pick(t.capacity(budget_bits))


def frontier(t: Table, points: int = 200) -> list[tuple[int, float]]:
    """(total bits, least predicted KL) at up to `points` budgets, where the KL drops."""
    caps = np.unique(np.linspace(0, len(t.best) - 1, num=min(points, len(t.best))).astype(int))
    out: list[tuple[int, float]] = []
    for c in caps:
        kl = float(t.best[c])
        if math.isfinite(kl) and (not out or kl < out[-1][1]):
            out.append((t.floor_bits + int(c) * t.unit, kl))
    return out
