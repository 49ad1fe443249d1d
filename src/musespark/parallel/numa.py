"""NUMA placement of the ranks of one host (docs/parallel.md §11): which node's CPUs each rank's
threads run on, and so on which node its weights are first touched.

Linux places a page on the node of the thread that first writes it. A rank loads its shard by
copying each tensor out of the memory-mapped checkpoint (model/load.py) and packs its panels at
its first step, all on its own threads; pinned to one node before it loads, a rank's weights
are therefore resident on that node, and its threads read them there instead of across the
socket link. The layout is read from sysfs (`/sys/devices/system/node/node*/cpulist`; `root`
injectable for tests); `MUSESPARK_NUMA=0` turns placement off (the threads then run wherever
the scheduler puts them and the weights land wherever they are first written).

Ranks go to nodes in contiguous blocks (rank r of w on node r * n // w), so that with one rank
per node each socket holds one rank's shard; ranks that share a node split its CPUs (those
this process may run on) evenly, in order, at least one each; with fewer ranks than nodes
(one rank per host under a launcher) each rank takes its block of whole nodes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

NUMA_ENV = "MUSESPARK_NUMA"  # "0": no placement (where threads run changes no number computed)
SYSFS_NODES = Path("/sys/devices/system/node")


@dataclass(frozen=True)
class Node:
    id: int
    cpus: tuple[int, ...]


@dataclass(frozen=True)
class Placement:
    rank: int
    nodes: tuple[int, ...]  # one node, or several when there are fewer ranks than nodes
    cpus: tuple[int, ...]  # the CPUs this rank's threads are pinned to (its thread count)

    @property
    def node(self) -> int:
        return self.nodes[0]

    def describe(self) -> str:
        where = f"node {self.node}" if len(self.nodes) == 1 else f"nodes {format_cpulist(self.nodes)}"
        return (
            f"rank {self.rank}: {where}, CPUs {format_cpulist(self.cpus)} ({len(self.cpus)} threads); "
            f"its shard of the weights is first touched on {where}"
        )


def parse_cpulist(text: str) -> tuple[int, ...]:
    """'0-3,8,10-11' (sysfs cpulist) -> (0, 1, 2, 3, 8, 10, 11). Raises ValueError on other text."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi) if hi else int(lo)
        if last < first:
            raise ValueError(f"bad cpulist range {part!r}")
        cpus.extend(range(first, last + 1))
    return tuple(sorted(set(cpus)))


def format_cpulist(cpus: tuple[int, ...]) -> str:
    """The inverse of parse_cpulist, with ranges collapsed."""
    runs: list[str] = []
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        runs.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(runs)


def read_nodes(root: Path | str = SYSFS_NODES) -> list[Node]:
    """The nodes with CPUs under `root` (node<N>/cpulist), by id; [] when there is no such tree
    (not Linux, or a container without sysfs): no placement then."""
    root = Path(root)
    nodes = []
    for d in root.glob("node[0-9]*"):
        f = d / "cpulist"
        if d.name[4:].isdigit() and f.is_file():
            cpus = parse_cpulist(f.read_text())
            if cpus:
                nodes.append(Node(int(d.name[4:]), cpus))
    return sorted(nodes, key=lambda n: n.id)


def place_ranks(nodes: list[Node], world: int, allowed: set[int] | None = None) -> list[Placement]:
    """Each of `world` ranks' node and CPUs (the module docstring); `allowed`: the CPUs this
    process may use (None: all). Nodes with no allowed CPU are skipped; [] when none is left."""
    usable = [Node(n.id, tuple(c for c in n.cpus if allowed is None or c in allowed)) for n in nodes]
    usable = [n for n in usable if n.cpus]
    if not usable or world < 1:
        return []
    n = len(usable)
    node_of = [r * n // world for r in range(world)]
    out = []
    for r in range(world):
        if world < n:  # fewer ranks than nodes: each rank takes whole nodes, [r n / w, (r + 1) n / w)
            mine = usable[node_of[r] : (r + 1) * n // world]
            out.append(Placement(r, tuple(m.id for m in mine), tuple(c for m in mine for c in m.cpus)))
            continue
        node = usable[node_of[r]]
        peers = [q for q in range(world) if node_of[q] == node_of[r]]
        k, i = len(peers), peers.index(r)
        if k <= len(node.cpus):  # an even split, the first ones one CPU more
            size, extra = divmod(len(node.cpus), k)
            start = i * size + min(i, extra)
            cpus = node.cpus[start : start + size + (1 if i < extra else 0)]
        else:  # more ranks than CPUs: one each, shared round-robin
            cpus = (node.cpus[i % len(node.cpus)],)
        out.append(Placement(r, (node.id,), cpus))
    return out


def enabled() -> bool:
    value = os.environ.get(NUMA_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{NUMA_ENV}={value!r}: expected 0 or 1")
    return value == "1"


def placement(rank: int, world: int, root: Path | str = SYSFS_NODES) -> Placement | None:
    """This rank's placement on this host, or None (placement off, or no node layout)."""
    if not enabled():
        return None
    allowed = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    placed = place_ranks(read_nodes(root), world, allowed)
    return placed[rank] if placed else None


def pin(place: Placement | None) -> tuple[int, ...] | None:
    """Pins the calling thread (and the threads it starts later, such as torch's pool) to the
    placement's CPUs; returns the CPUs it ran on before (to restore), or None when nothing changed."""
    if place is None or not hasattr(os, "sched_setaffinity"):
        return None
    before = tuple(sorted(os.sched_getaffinity(0)))
    os.sched_setaffinity(0, place.cpus)
    return before
