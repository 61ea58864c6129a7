"""deploy/k8s as `kubectl kustomize` renders it, and how the deploy tests read the objects.

`render` runs the real `kubectl kustomize` (Debian package kubectl, with kustomize v5; the
tests that need it skip without it) once per kustomization and process: it is cached, so
the k8s test modules of one session share each rendering. The other functions read a
container's command-line options, its environment as the kubelet expands `$(VAR)`, its
ports, and the volume (Secret, ConfigMap, claim or emptyDir) that a path lies on.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import PurePosixPath

import pytest
import yaml
from deploy_tree import DEPLOY

K8S = DEPLOY / "k8s"
KUSTOMIZATIONS = {"base": K8S / "base", "cpu": K8S / "overlays" / "cpu"}

COORDINATOR_SERVICE = "ripples-coordinator"
WORKER_METRICS_PORTS = (9401, 9499)
"""The range the NetworkPolicy opens to Prometheus: one port per local rank from 9401."""

KUBECTL = shutil.which("kubectl")


@dataclass(frozen=True)
class Rendering:
    """The objects `kubectl kustomize` makes of one kustomization."""

    name: str
    objects: list[dict]

    def get(self, kind: str, name: str) -> dict:
        found = [o for o in self.objects
                 if o["kind"] == kind and o["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.name}: expected one {kind} {name}, found {len(found)}"
        return found[0]

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def workloads(self) -> list[dict]:
        return [o for o in self.objects if o["kind"] in ("Deployment", "DaemonSet")]

    def pod(self, component: str) -> dict:
        """The pod template of the workload of that component label."""
        (workload,) = [w for w in self.workloads() if labels(w["spec"]["template"])
                       .get("app.kubernetes.io/component") == component]
        return workload["spec"]["template"]

    def container(self, component: str) -> dict:
        (container,) = self.pod(component)["spec"]["containers"]
        return container


def kubectl() -> str:
    if KUBECTL is None:
        pytest.skip("kubectl not found: install the Debian package kubectl")
    version = json.loads(subprocess.run([KUBECTL, "version", "--client", "-o", "json"],
                                        capture_output=True, text=True, timeout=60).stdout
                         or "{}")
    kustomize = version.get("kustomizeVersion", "")
    if not re.match(r"v([5-9]|\d\d)\.", kustomize):
        pytest.skip(f"{KUBECTL} embeds kustomize {kustomize or '(unknown)'}: these "
                    "kustomizations need v5 (kubectl 1.27 or later; Debian package kubectl)")
    return KUBECTL


@functools.cache
def render(name: str) -> Rendering:
    result = subprocess.run([kubectl(), "kustomize", str(KUSTOMIZATIONS[name])],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"kubectl kustomize {name}: {result.stderr}"
    return Rendering(name, [o for o in yaml.safe_load_all(result.stdout) if o])


def labels(obj: dict) -> dict[str, str]:
    return obj["metadata"].get("labels", {})


def arg_options(args: list[str]) -> dict[str, str]:
    """`--name=value` options of a command (the form the manifests use throughout);
    a bare flag maps to ""."""
    options = {}
    for arg in args:
        if arg.startswith("--"):
            name, _, value = arg[2:].partition("=")
            options[name] = value
    return options


def expand_env(args: list[str], container: dict) -> list[str]:
    """`$(VAR)` as the kubelet expands it from the container's environment (downward-API
    fields become example values)."""
    examples = {"spec.nodeName": "node-0", "status.podIP": "10.244.1.7"}
    env: dict[str, str] = {}
    for variable in container.get("env", []):
        env[variable["name"]] = (variable["value"] if "value" in variable else
                                 examples[variable["valueFrom"]["fieldRef"]["fieldPath"]])

    def value(match: re.Match[str]) -> str:
        assert match.group(1) in env, (
            f"{container['name']}: $({match.group(1)}) is not in its env (the kubelet "
            "would pass it on literally)")
        return env[match.group(1)]

    return [re.sub(r"\$\((\w+)\)", value, arg) for arg in args]


def container_ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def port_number(container: dict, port: int | str) -> int:
    return container_ports(container)[port] if isinstance(port, str) else port


def is_ripples_image(container: dict) -> bool:
    """REGISTRY[:PORT]/PATH/ripples[:TAG][@DIGEST]"""
    return container["image"].split("@")[0].rsplit("/", 1)[-1].split(":")[0] == "ripples"


def file_source(pod: dict, container: dict, path: str) -> tuple[str, str, str]:
    """(volume kind, its secret/configMap/claim name or "", key or relative path) of the
    volume that `path` lies on in `container`."""
    mounts = [m for m in container.get("volumeMounts", [])
              if PurePosixPath(path).is_relative_to(m["mountPath"])]
    assert mounts, f"{container['name']}: {path} is on no volume"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    relative = str(PurePosixPath(path).relative_to(mount["mountPath"]))
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    for kind, name_field in (("secret", "secretName"), ("configMap", "name")):
        if kind in volume:
            items = {i["path"]: i["key"] for i in volume[kind].get("items", [])}
            assert not items or relative in items, f"{path}: not among {sorted(items)}"
            return kind, volume[kind][name_field], items.get(relative, relative)
    if "persistentVolumeClaim" in volume:
        return "persistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"], relative
    (kind,) = set(volume) - {"name"}
    assert not mount.get("readOnly"), f"{container['name']}: {path} is read-only"
    return kind, "", relative
