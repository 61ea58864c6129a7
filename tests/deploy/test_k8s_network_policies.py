"""deploy/k8s's NetworkPolicies admit exactly the flows a run needs.

A small evaluator of NetworkPolicy (matchLabels pod selectors, ports, named ports and port
ranges; both the source's egress and the destination's ingress must allow a flow) runs
over the policies `kubectl kustomize` renders (tests/deploy/k8s_rendering.py): every pod
of the run is isolated both ways and can resolve names, the flows of a run are admitted,
and an outsider's and the other flows between the run's pods are denied.
"""

from __future__ import annotations

from dataclasses import dataclass

from k8s_rendering import WORKER_METRICS_PORTS, Rendering, container_ports, labels


@dataclass(frozen=True)
class Pod:
    labels: dict[str, str]
    ports: dict[str, int]


# A pod of the same namespace that is no part of the run (the strictest outsider: other
# namespaces match no podSelector at all), and the cluster's DNS.
OUTSIDER = Pod({"app.kubernetes.io/name": "intruder"}, {})
CLUSTER_DNS = Pod({"k8s-app": "kube-dns"}, {})


def _selects(selector: dict, pod: Pod) -> bool:
    assert set(selector) <= {"matchLabels"}, f"this evaluator knows matchLabels only: {selector}"
    return selector.get("matchLabels", {}).items() <= pod.labels.items()


def _peer_is(peer: dict, pod: Pod) -> bool:
    assert set(peer) == {"podSelector"}, f"this evaluator knows podSelector peers only: {peer}"
    return pod is not CLUSTER_DNS and _selects(peer["podSelector"], pod)


def _port_in(rule: dict, port: int, protocol: str, destination: Pod) -> bool:
    if not rule.get("ports"):
        return True
    for allowed in rule["ports"]:
        number = allowed.get("port")
        if allowed.get("protocol", "TCP") != protocol:
            continue
        if number is None:
            return True
        if isinstance(number, str):  # a named port: the destination's
            number = destination.ports.get(number, -1)
        if number <= port <= allowed.get("endPort", number):
            return True
    return False


def _admits(policies: list[dict], source: Pod, destination: Pod, port: int,
            protocol: str = "TCP") -> bool:
    """Whether NetworkPolicy lets `source` open `port` on `destination`: the source's
    egress and the destination's ingress must both allow it (a pod no policy of a
    direction selects is open in that direction)."""
    def allowed(direction: str, pod: Pod, peers: str, other: Pod) -> bool:
        selecting = [p["spec"] for p in policies if _selects(p["spec"]["podSelector"], pod)
                     and direction in p["spec"]["policyTypes"]]
        if not selecting:
            return True
        return any((not rule.get(peers) or any(_peer_is(peer, other) for peer in rule[peers]))
                   and _port_in(rule, port, protocol, destination)
                   for spec in selecting for rule in spec.get(direction.lower(), []))

    return (allowed("Egress", source, "to", destination)
            and allowed("Ingress", destination, "from", source))


ADMITTED = [
    ("agent", "coordinator", 50051), ("agent", "coordinator", 29400),
    ("agent", "agent", 29500), ("agent", "agent", 47123),  # gloo/NCCL's own ports
    ("dashboard", "coordinator", 50051),
    ("prometheus", "coordinator", 9400),
    ("prometheus", "agent", WORKER_METRICS_PORTS[0]), ("prometheus", "agent", 9404),
    ("prometheus", "agent", WORKER_METRICS_PORTS[1]),
    ("grafana", "prometheus", 9090),
]
DENIED = [
    ("outsider", "coordinator", 29400), ("outsider", "coordinator", 50051),
    ("outsider", "coordinator", 9400), ("outsider", "agent", 29500),
    ("outsider", "agent", 9401), ("outsider", "prometheus", 9090),
    ("outsider", "dashboard", 8080), ("outsider", "grafana", 3000),
    ("dashboard", "coordinator", 29400), ("dashboard", "coordinator", 9400),
    ("dashboard", "agent", 29500),
    ("prometheus", "coordinator", 50051), ("prometheus", "coordinator", 29400),
    ("prometheus", "agent", 29500), ("prometheus", "agent", 9500),
    ("grafana", "coordinator", 9400), ("grafana", "agent", 9401),
    ("coordinator", "agent", 29500), ("coordinator", "outsider", 443),
    ("agent", "dashboard", 8080), ("agent", "prometheus", 9090), ("agent", "outsider", 443),
]


def test_network_policies_admit_exactly_the_runs_flows(rendered: Rendering) -> None:
    policies = rendered.of_kind("NetworkPolicy")
    pods = {"outsider": OUTSIDER}
    for workload in rendered.workloads():
        template = workload["spec"]["template"]
        (container,) = template["spec"]["containers"]
        pods[labels(template)["app.kubernetes.io/component"]] = Pod(
            labels(template), container_ports(container))
    for name, pod in pods.items():
        if pod is OUTSIDER:
            continue
        # Default deny, both ways, for every pod of the run (the data plane is open).
        types = {t for p in policies if _selects(p["spec"]["podSelector"], pod)
                 for t in p["spec"]["policyTypes"]}
        assert types == {"Ingress", "Egress"}, f"{name}: isolated only for {types}"
        assert _admits(policies, pod, CLUSTER_DNS, 53, "UDP"), f"{name} cannot resolve names"
    wrong = [f"{s} -> {d}:{p} should be admitted" for s, d, p in ADMITTED
             if not _admits(policies, pods[s], pods[d], p)]
    wrong += [f"{s} -> {d}:{p} should be denied" for s, d, p in DENIED
              if _admits(policies, pods[s], pods[d], p)]
    assert not wrong, "\n".join(wrong)
