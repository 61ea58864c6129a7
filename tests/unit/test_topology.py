"""Topologies: shapes, connectivity errors, spectral gap and A2CiD2's constants."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ripples.coordinator.config import RunSettings
from ripples.coordinator.topology import (
    DENSE_SPECTRUM_LIMIT,
    TOPOLOGIES,
    Topology,
    build_topology,
    parse_edge_list,
    read_edge_list,
)
from ripples.protocols.gossip.coordinator import a2cid2_constants

BUILT_IN = [t for t in TOPOLOGIES if t != "file"]


@pytest.mark.parametrize("name", BUILT_IN)
@pytest.mark.parametrize("n", [4, 8, 16])
def test_every_built_in_graph_is_connected_symmetric_and_loop_free(name: str, n: int) -> None:
    t = build_topology(name, n, nodes=[r // 4 for r in range(n)])
    assert t.num_workers == n
    assert len(t.components()) == 1
    for i, ns in enumerate(t.neighbours):
        assert i not in ns and list(ns) == sorted(set(ns))
        assert all(i in t.neighbours[j] for j in ns)
    assert 0 < t.spectral_gap() <= 1


def test_graph_shapes() -> None:
    assert build_topology("ring", 8).neighbours[0] == (1, 7)
    assert build_topology("ring-based", 8).neighbours[0] == (1, 4, 7)
    assert build_topology("exponential", 8).neighbours[0] == (1, 2, 4, 6, 7)
    assert len(build_topology("complete", 8).edges()) == 28
    double = build_topology("double-ring", 8)  # two ring-based graphs of 4, joined i ~ i+4
    assert double.neighbours[0] == (1, 2, 3, 4)
    assert double.neighbours[5] == (1, 4, 6, 7)
    hier = build_topology("hierarchical", 6, nodes=[0, 0, 0, 1, 1, 1])
    assert hier.neighbours[0] == (1, 2, 3)  # its host, and the first worker of the next
    assert hier.neighbours[4] == (1, 3, 5)


def test_spectral_gap_matches_the_expected_gossip_matrix() -> None:
    # Complete graph: E[W] = I - (nI - J) / (n(n-1)), so 1 - lambda_2 = 1/(n-1).
    assert build_topology("complete", 8).spectral_gap() == pytest.approx(1 / 7)
    # Ring: edge weight 1/2, lambda_2(L) = 1 - cos(2 pi / n).
    assert build_topology("ring", 8).spectral_gap() == pytest.approx(
        (1 - math.cos(2 * math.pi / 8)) / 8)
    # A sparser graph mixes more slowly.
    gaps = [build_topology(t, 16).spectral_gap() for t in ("ring", "ring-based", "complete")]
    assert gaps == sorted(gaps)


def test_a2cid2_constants_match_the_reference_values() -> None:
    c16 = a2cid2_constants(build_topology("ring", 16), 1.0)
    assert c16.chi_1 == pytest.approx(13.1, abs=0.05)
    assert c16.chi_2 == pytest.approx(0.94, abs=0.005)
    assert c16.eta == pytest.approx(0.143, abs=0.001)
    assert c16.alpha_tilde == pytest.approx(1.87, abs=0.005)
    assert c16.alpha == 0.5
    c64 = a2cid2_constants(build_topology("ring", 64), 1.0)
    assert c64.eta == pytest.approx(0.035, abs=0.0005)
    assert c64.alpha_tilde == pytest.approx(7.26, abs=0.005)
    # On the complete graph chi_1 = chi_2: the momentum copy moves like the model.
    complete = a2cid2_constants(build_topology("complete", 8), 2.0)
    assert complete.chi_1 == pytest.approx(complete.chi_2)
    assert complete.alpha_tilde == pytest.approx(0.5)
    # Doubling the rate halves both chis, so eta doubles and alpha~ stays.
    double = a2cid2_constants(build_topology("ring", 16), 2.0)
    assert double.eta == pytest.approx(2 * c16.eta)
    assert double.alpha_tilde == pytest.approx(c16.alpha_tilde)


def test_chi_2_is_the_largest_half_effective_resistance() -> None:
    t = build_topology("ring-based", 6)
    lap = t.laplacian()
    # Effective resistance from the definition: solve L v = e_i - e_j on the mean-zero space.
    worst = 0.0
    for i, j in t.edges():
        b = np.zeros(6)
        b[i], b[j] = 1.0, -1.0
        v = np.linalg.lstsq(lap, b, rcond=None)[0]
        worst = max(worst, 0.5 * (v[i] - v[j]))
    assert a2cid2_constants(t, 1.0).chi_2 == pytest.approx(worst)


def test_bipartite_detection() -> None:
    assert build_topology("ring", 8).is_bipartite()
    colours = build_topology("ring", 8).two_colouring()
    assert colours == (0, 1, 0, 1, 0, 1, 0, 1)
    assert not build_topology("ring", 7).is_bipartite()
    assert not build_topology("complete", 4).is_bipartite()


def test_disconnected_graphs_are_rejected_with_the_components() -> None:
    with pytest.raises(ValueError, match=r"disconnected \(2 components: \{0, 1\}; \{2, 3\}\)"):
        Topology.from_edges("file", 4, [(0, 1), (2, 3)])
    with pytest.raises(ValueError, match="self loop"):
        Topology.from_edges("file", 3, [(0, 1), (1, 1), (1, 2)])
    with pytest.raises(ValueError, match="outside 0..2"):
        Topology.from_edges("file", 3, [(0, 1), (1, 3)])
    with pytest.raises(ValueError, match="even number"):
        build_topology("double-ring", 6 + 1)
    with pytest.raises(ValueError, match="unknown topology 'star'"):
        build_topology("star", 4)


def test_edge_list_files(tmp_path) -> None:
    assert parse_edge_list("# a star\n0 1\n0 2  # hub\n\n0,3\n") == [(0, 1), (0, 2), (0, 3)]
    with pytest.raises(ValueError, match="line 2: expected two ranks 'i j', got '0 1 2'"):
        parse_edge_list("0 1\n0 1 2\n")
    with pytest.raises(ValueError, match="no edges"):
        parse_edge_list("# nothing\n")
    path = tmp_path / "star.txt"
    path.write_text("0 1\n0 2\n0 3\n")
    edges = read_edge_list(str(path))
    run = RunSettings(protocol="a2cid2", num_workers=4, topology="file", topology_edges=edges)
    assert run.topology_edges == [(0, 1), (0, 2), (0, 3)]
    with pytest.raises(ValueError, match="disconnected"):
        RunSettings(protocol="a2cid2", num_workers=4, topology="file",
                    topology_edges=[(0, 1), (2, 3)])
    with pytest.raises(ValueError, match="cannot read the topology file .*missing.txt"):
        read_edge_list(str(tmp_path / "missing.txt"))


def test_run_settings_refuse_topologies_that_cannot_work() -> None:
    with pytest.raises(ValueError, match="takes no topology"):
        RunSettings(protocol="allreduce", topology="ring")
    with pytest.raises(ValueError, match="odd cycle"):
        RunSettings.build(protocol="adpsgd", adpsgd_mode="bipartite", topology="ring",
                          num_workers=5)
    with pytest.raises(ValueError, match="rate_com"):
        RunSettings.build(protocol="a2cid2", rate_com=0)
    with pytest.raises(ValueError, match="topology 'file' needs its edges"):
        RunSettings(protocol="a2cid2", topology="file")
    RunSettings.build(protocol="adpsgd", adpsgd_mode="bipartite", topology="ring", num_workers=6)


@pytest.mark.parametrize("name", ["ring", "ring-based", "exponential", "complete"])
@pytest.mark.parametrize("n", [5, 6, 8, 13, 16])
def test_closed_form_spectra_equal_the_dense_eigendecomposition(name: str, n: int) -> None:
    """Circulant graphs and the complete graph skip the dense n x n eigendecomposition
    (the coordinator at 10,000+ workers): their closed forms must give the same numbers."""
    fast = build_topology(name, n)
    dense = Topology(name=name, neighbours=tuple(
        tuple(j for j in range(n) if j != i and (min(i, j), max(i, j)) in set(fast.edges()))
        for i in range(n)))
    assert fast.spectral_gap() == pytest.approx(dense.spectral_gap(), rel=1e-9)
    for rate in (0.5, 2.0):
        a, b = a2cid2_constants(fast, rate), a2cid2_constants(dense, rate)
        assert (a.chi_1, a.chi_2, a.eta, a.alpha_tilde) == pytest.approx(
            (b.chi_1, b.chi_2, b.eta, b.alpha_tilde), rel=1e-9)


def test_large_topologies_without_a_closed_form_are_refused_where_their_spectrum_is_needed(
        ) -> None:
    big = build_topology("complete", 100_000)
    assert big.complete and big.spectral_gap() == pytest.approx(1 / 99_999)
    assert build_topology("ring", 50_000).spectral_gap() > 0
    wide = build_topology("double-ring", 2 * (DENSE_SPECTRUM_LIMIT // 2 + 1))
    assert wide.spectral_gap() > 0  # a sparse solver: only A2CiD2's constants need more
    with pytest.raises(ValueError, match="dense pseudo-inverse"):
        a2cid2_constants(wide, 1.0)


@pytest.mark.parametrize("name", ["double-ring", "hierarchical"])
def test_the_sparse_spectral_gap_equals_the_dense_one(name: str) -> None:
    t = build_topology(name, 48, nodes=[r // 4 for r in range(48)])
    assert t._sparse_lambda_2() == pytest.approx(t.algebraic_connectivity(), rel=1e-6)
