"""Ratios that hold from run to run: rounds in alternating order, and the median of the per-pair ratios.

A ratio of two contenders timed one after the other moves with the machine's load by more than a target's
margin. Here they are timed in rounds instead: each round runs every contender once, in one order in rounds
0, 2, 4, ... and in the reverse order in rounds 1, 3, ... (AB, BA, AB, ...), so that neither always runs first
or always follows the same neighbour; a ratio is the median of its per-round ratios, reported with their
minimum, maximum and number of pairs (the way CMU 11-868 grades its speed-ups). Imports nothing heavy.
"""
import statistics


def rounds(runs: dict, k: int):
    "`k` rounds of `runs` (name -> call returning a rate): in the dict's order, then reversed, alternately."
    out, order = {name: [] for name in runs}, []
    for i in range(k):
        names = list(runs) if i % 2 == 0 else list(runs)[::-1]
        for name in names: out[name].append(runs[name]())
        order.append(names)
    return out, order


def paired(a: list, b: list) -> dict:
    "`a`'s rate over `b`'s, round by round: the median, the spread (min, max) and the number of pairs."
    if len(a) != len(b) or not a: raise ValueError(f"{len(a)} and {len(b)} rates: pair one of each per round")
    r = [x / y for x, y in zip(a, b)]
    return {"ratio": statistics.median(r), "min": min(r), "max": max(r), "pairs": len(r), "per_pair": r}


def crossing(points: list, target: float):
    "The first (seconds, step) at which a curve of (seconds, step, loss) points reaches `target`, interpolated."
    for (t0, s0, l0), (t1, s1, l1) in zip(points, points[1:]):
        if l1 <= target:
            f = 1.0 if l0 == l1 else min(max((l0 - target) / (l0 - l1), 0.0), 1.0)
            return t0 + f * (t1 - t0), s0 + f * (s1 - s0)
    return None, None


def summary_line(name: str, r: dict) -> str:
    "One printed line: a paired ratio, its spread and its number of pairs."
    return f"{name}: {r['ratio']:.3f} (min {r['min']:.3f}, max {r['max']:.3f}, {r['pairs']} pairs)"


