"""deploy/k8s's pods run locked down, and the agents have one worker per GPU (two on CPU).

On the objects `kubectl kustomize` renders (tests/deploy/k8s_rendering.py): every workload
runs as a non-root user with no service-account token, a read-only root filesystem, no
capability and resource requests and limits; the Ripples image is the package's version
and the others those compose.yaml runs; the agents drain on SIGTERM, register their node
and pod address, and get a GPU each in the base, none in the CPU overlay.
"""

from __future__ import annotations

import json
import tomllib

import yaml
from deploy_tree import DEPLOY, REPO, RIPPLES_UID
from k8s_rendering import (
    KUSTOMIZATIONS,
    Rendering,
    arg_options,
    expand_env,
    is_ripples_image,
    render,
)


def test_pods_run_locked_down(rendered: Rendering) -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    compose_images = {s["image"] for s in yaml.safe_load((DEPLOY / "compose.yaml").read_text())
                      ["services"].values() if not s.get("image", "").startswith("ripples")}
    for workload in rendered.workloads():
        name = workload["metadata"]["name"]
        spec = workload["spec"]["template"]["spec"]
        assert spec["automountServiceAccountToken"] is False, name
        assert spec["enableServiceLinks"] is False, name
        pod_security = spec["securityContext"]
        assert pod_security["runAsNonRoot"] is True, name
        assert pod_security["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod_security["runAsUser"] >= 10000, name
        for container in spec["containers"]:
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, name
            assert security["readOnlyRootFilesystem"] is True, name
            assert security["capabilities"] == {"drop": ["ALL"]}, name
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= container["resources"][kind].keys(), (name, kind)
            if is_ripples_image(container):
                assert pod_security["runAsUser"] == RIPPLES_UID, name
                assert container["image"] == f"ripples:{version}", (
                    f"{name}: kustomization.yaml's images: newTag should be the package "
                    f"version {version}")
            else:
                assert container["image"] in compose_images, (
                    f"{name}: {container['image']} is not the version compose.yaml runs")


def test_agents_run_one_worker_per_gpu_or_two_on_cpu() -> None:
    for name in KUSTOMIZATIONS:
        rendering = render(name)
        agents = rendering.get("DaemonSet", "ripples-agent")["spec"]["template"]["spec"]
        (container,) = agents["containers"]
        nproc = int(arg_options(expand_env(container["args"], container))["nproc-per-node"])
        resources = container["resources"]
        # SIGTERM drains: the workers leave their groups and the run before the kill.
        assert agents["terminationGracePeriodSeconds"] >= 60
        assert arg_options(container["args"])["host"] == "$(NODE_NAME)"
        env = {e["name"]: e for e in container["env"]}
        assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
        # Prometheus scrapes the workers at the pod's address, not at whatever address
        # the coordinator sees their connections come from (a SNAT on the way).
        assert arg_options(container["args"])["metrics-host"] == "$(POD_IP)"
        assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        if name == "base":
            assert resources["limits"]["nvidia.com/gpu"] == nproc == 1
            assert agents["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
            assert {"key": "nvidia.com/gpu", "operator": "Exists",
                    "effect": "NoSchedule"} in agents["tolerations"]
        else:
            assert nproc == 2
            assert "nvidia.com/gpu" not in json.dumps(agents)
            assert not agents.get("nodeSelector") and not agents.get("tolerations")
