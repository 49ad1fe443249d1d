"""NUMA placement (parallel/numa.py) on a fake two-node sysfs tree: the layout is read, each
rank gets its node's CPUs (split among the ranks that share a node), the calling thread is
pinned to them, and MUSESPARK_NUMA=0 turns placement off. The machine at hand has one node,
so these test the logic, not the speed."""

from __future__ import annotations

from pathlib import Path

import pytest

from musespark.parallel import numa


def fake_sysfs(root: Path, nodes: dict[int, str]) -> Path:
    for node, cpulist in nodes.items():
        (root / f"node{node}").mkdir(parents=True)
        (root / f"node{node}" / "cpulist").write_text(cpulist + "\n")
    (root / "possible").write_text("0-1\n")  # sysfs files beside the node folders are ignored
    return root


@pytest.fixture
def two_nodes(tmp_path):
    return fake_sysfs(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15"})


def test_cpulists_parse_and_format():
    assert numa.parse_cpulist("0-3,8,10-11") == (0, 1, 2, 3, 8, 10, 11)
    assert numa.format_cpulist((0, 1, 2, 3, 8, 10, 11)) == "0-3,8,10-11"
    with pytest.raises(ValueError):
        numa.parse_cpulist("3-1")


def test_reads_the_node_layout(two_nodes):
    nodes = numa.read_nodes(two_nodes)
    assert [(n.id, n.cpus) for n in nodes] == [(0, (0, 1, 2, 3, 8, 9, 10, 11)), (1, (4, 5, 6, 7, 12, 13, 14, 15))]
    assert numa.read_nodes(two_nodes / "absent") == []


def test_one_rank_per_node(two_nodes):
    placed = numa.place_ranks(numa.read_nodes(two_nodes), world=2)
    assert [(p.rank, p.node, p.cpus) for p in placed] == [
        (0, 0, (0, 1, 2, 3, 8, 9, 10, 11)),
        (1, 1, (4, 5, 6, 7, 12, 13, 14, 15)),
    ]
    assert "first touched on node 1" in placed[1].describe()


def test_ranks_sharing_a_node_split_its_cpus(two_nodes):
    placed = numa.place_ranks(numa.read_nodes(two_nodes), world=4)
    assert [(p.node, p.cpus) for p in placed] == [
        (0, (0, 1, 2, 3)),
        (0, (8, 9, 10, 11)),
        (1, (4, 5, 6, 7)),
        (1, (12, 13, 14, 15)),
    ]
    # only the CPUs this process may use; a node left without any is skipped
    placed = numa.place_ranks(numa.read_nodes(two_nodes), world=2, allowed={4, 5, 6})
    assert [(p.node, p.cpus) for p in placed] == [(1, (4, 5)), (1, (6,))]
    # more ranks than CPUs: one each, shared
    placed = numa.place_ranks([numa.Node(0, (0, 1))], world=3)
    assert [p.cpus for p in placed] == [(0,), (1,), (0,)]


def test_fewer_ranks_than_nodes_take_whole_nodes(tmp_path):
    root = fake_sysfs(tmp_path, {0: "0-1", 1: "2-3", 2: "4-5", 3: "6-7"})
    placed = numa.place_ranks(numa.read_nodes(root), world=2)
    assert [(p.nodes, p.cpus) for p in placed] == [((0, 1), (0, 1, 2, 3)), ((2, 3), (4, 5, 6, 7))]
    (one,) = numa.place_ranks(numa.read_nodes(root), world=1)
    assert one.nodes == (0, 1, 2, 3) and "nodes 0-3" in one.describe()


def test_pins_the_rank_to_its_node(two_nodes, monkeypatch):
    calls = []
    monkeypatch.setattr(numa.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(numa.os, "sched_setaffinity", lambda pid, cpus: calls.append((pid, tuple(cpus))))
    place = numa.placement(1, 2, root=two_nodes)
    assert place is not None and place.node == 1
    assert numa.pin(place) == tuple(range(16))
    assert calls == [(0, (4, 5, 6, 7, 12, 13, 14, 15))]


def test_the_knob_turns_placement_off(two_nodes, monkeypatch):
    monkeypatch.setenv(numa.NUMA_ENV, "0")
    assert numa.placement(0, 2, root=two_nodes) is None
    assert numa.pin(None) is None
    monkeypatch.setenv(numa.NUMA_ENV, "yes")
    with pytest.raises(ValueError, match="MUSESPARK_NUMA"):
        numa.placement(0, 2, root=two_nodes)
