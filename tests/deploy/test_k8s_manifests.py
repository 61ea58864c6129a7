"""deploy/k8s renders, is valid Kubernetes, passes checkov, and agrees with the code.

Real tools, no cluster: `kubectl kustomize` renders the base and the CPU overlay (Debian
package kubectl; the tests that need it skip without it), kubernetes-validate checks every
rendered object against the Kubernetes API's schema (strict: no unknown field), checkov
runs its Kubernetes checks on the rendered manifests (from a venv of its own under
pytest's cache: its pins would downgrade packages of this project's venv), promtool
checks the Prometheus config. The other tests read the rendered objects: the commands
parse with the real `ripples` parser, Services reach declared container ports, the
NetworkPolicies admit exactly the flows a run needs, each process reads the Secret keys
it should and no other, and Grafana mounts deploy/grafana's files.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import kubernetes_validate
import pytest
import yaml

from ripples.cli.main import build_parser

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
KUSTOMIZATIONS = {"base": K8S / "base", "cpu": K8S / "overlays" / "cpu"}
DOCS = REPO / "docs" / "kubernetes.md"

KUBERNETES_VERSIONS = ("1.30", "1.37")
"""Schemas the rendered objects must satisfy: an old and the newest release that
kubernetes-validate's wheel ships (offline)."""
CHECKOV_VERSION = "3.3.30"

NAMESPACE = "ripples"
SECRETS = {"ripples-token", "ripples-read-token", "ripples-tls"}
COORDINATOR_SERVICE = "ripples-coordinator"
RIPPLES_UID = 10001  # the image's user (deploy/Dockerfile)
WORKER_METRICS_PORTS = (9401, 9499)
"""The range the NetworkPolicy opens to Prometheus: one port per local rank from 9401."""

KUBECTL = shutil.which("kubectl")
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not found: install the Debian package prometheus")


# ---------------------------------------------------------------------------- rendering


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
        (workload,) = [w for w in self.workloads() if _labels(w["spec"]["template"])
                       .get("app.kubernetes.io/component") == component]
        return workload["spec"]["template"]

    def container(self, component: str) -> dict:
        (container,) = self.pod(component)["spec"]["containers"]
        return container


def _kubectl() -> str:
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
def _render(name: str) -> Rendering:
    result = subprocess.run([_kubectl(), "kustomize", str(KUSTOMIZATIONS[name])],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"kubectl kustomize {name}: {result.stderr}"
    return Rendering(name, [o for o in yaml.safe_load_all(result.stdout) if o])


@pytest.fixture(params=sorted(KUSTOMIZATIONS))
def rendered(request: pytest.FixtureRequest) -> Rendering:
    return _render(request.param)


def _labels(obj: dict) -> dict[str, str]:
    return obj["metadata"].get("labels", {})


def _options(args: list[str]) -> dict[str, str]:
    """`--name=value` options of a command (the form the manifests use throughout);
    a bare flag maps to ""."""
    options = {}
    for arg in args:
        if arg.startswith("--"):
            name, _, value = arg[2:].partition("=")
            options[name] = value
    return options


def _expand(args: list[str], container: dict) -> list[str]:
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


def _ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def _port_number(container: dict, port: int | str) -> int:
    return _ports(container)[port] if isinstance(port, str) else port


def _is_ripples_image(container: dict) -> bool:
    """REGISTRY[:PORT]/PATH/ripples[:TAG][@DIGEST]"""
    return container["image"].split("@")[0].rsplit("/", 1)[-1].split(":")[0] == "ripples"


# ---------------------------------------------------------------------------- render + schema


def test_kustomizations_render_the_whole_stack(rendered: Rendering) -> None:
    kinds = {(o["kind"], o["metadata"]["name"]) for o in rendered.objects
             if o["kind"] != "ConfigMap"}
    assert kinds == {
        ("Namespace", NAMESPACE),
        ("PersistentVolumeClaim", "ripples-coordinator-state"),
        ("Deployment", "ripples-coordinator"), ("Service", "ripples-coordinator"),
        ("DaemonSet", "ripples-agent"),
        ("Deployment", "ripples-dashboard"), ("Service", "ripples-dashboard"),
        ("Deployment", "prometheus"), ("Service", "prometheus"),
        ("Deployment", "grafana"), ("Service", "grafana"),
        *(("NetworkPolicy", n) for n in ("ripples-default-deny", "ripples-dns",
                                          "ripples-coordinator", "ripples-agent",
                                          "ripples-dashboard", "prometheus", "grafana")),
    }
    config_maps = {re.sub(r"-[a-z0-9]{10}$", "", c["metadata"]["name"])
                   for c in rendered.of_kind("ConfigMap")}
    assert config_maps == {"prometheus-config", "grafana-dashboards", "grafana-datasources",
                           "grafana-dashboard-providers"}
    for obj in rendered.objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == NAMESPACE, obj["metadata"]["name"]
        assert _labels(obj).get("app.kubernetes.io/part-of") == "ripples", (
            obj["kind"], obj["metadata"]["name"])


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_follows_the_kubernetes_schema(rendered: Rendering, version: str) -> None:
    errors = []
    for obj in rendered.objects:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(map(str, error.path))
            errors.append(f"{where}: {path}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            errors.append(f"{where}: {error.message}")
    assert not errors, f"{rendered.name} against Kubernetes {version}:\n" + "\n".join(errors)


# ---------------------------------------------------------------------------- checkov


@pytest.fixture(scope="session")
def checkov(pytestconfig: pytest.Config) -> Path:
    """checkov, pinned, in a venv of its own under pytest's cache (made on first use):
    installed into this project's venv it would downgrade packaging, networkx and
    python-dateutil."""
    cache = getattr(pytestconfig, "cache", None)  # absent with -p no:cacheprovider
    if cache is None:
        pytest.skip("checkov lives in pytest's cache: run without -p no:cacheprovider")
    venv = cache.mkdir(f"checkov-{CHECKOV_VERSION}")
    installed = venv / ".installed"
    if not installed.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True,
                       capture_output=True, timeout=120)
        result = subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
             "--disable-pip-version-check", f"checkov=={CHECKOV_VERSION}"],
            capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            pytest.skip(f"could not install checkov=={CHECKOV_VERSION} into {venv} (is the "
                        f"package index reachable?): {result.stderr.strip()[-400:]}")
        installed.touch()
    return venv / "bin" / "checkov"


@pytest.mark.timeout(900)  # the first run installs checkov
def test_checkov_finds_no_failure_that_is_not_skipped_with_a_reason(
        checkov: Path, tmp_path: Path) -> None:
    for name in KUSTOMIZATIONS:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump_all(_render(name).objects, sort_keys=False))
    result = subprocess.run(
        [str(checkov), "--directory", str(tmp_path), "--framework", "kubernetes",
         "--output", "json", "--skip-download", "--compact"],
        capture_output=True, text=True, timeout=300)
    try:
        reports = json.loads(result.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"checkov exited {result.returncode} without a report: "
                    f"{result.stderr[-2000:]}")
    (report,) = reports if isinstance(reports, list) else [reports]
    assert report["check_type"] == "kubernetes"
    summary = report["summary"]
    assert summary["parsing_errors"] == 0 and summary["passed"] > 0, summary
    results = report["results"]
    failed = [f"{c['check_id']} {c['resource']} ({c['file_path']}): {c['check_name']}"
              for c in results["failed_checks"]]
    assert not failed, ("checkov failed checks; fix them, or skip one with an annotation "
                        "`checkov.io/skipN: CKV_ID=reason` and list it in docs/kubernetes.md:"
                        "\n" + "\n".join(failed))
    for check in results["skipped_checks"]:
        assert check["check_result"].get("suppress_comment"), (
            f"{check['check_id']} on {check['resource']} is skipped without a reason")


def _checkov_skips() -> Iterator[tuple[str, str, str]]:
    """(file, check id, reason) of every `checkov.io/skipN` annotation in deploy/k8s."""
    for path in sorted(K8S.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            annotations = ((doc or {}).get("metadata") or {}).get("annotations") or {}
            for key, value in annotations.items():
                if key.startswith("checkov.io/skip"):
                    assert re.fullmatch(r"checkov\.io/skip\d+", key), key
                    # checkov splits on "=": a second one in the reason breaks its parser.
                    assert value.count("=") == 1, f"{path}: {key}: one '=' only: {value}"
                    check, reason = value.split("=")
                    yield str(path.relative_to(REPO)), check, reason


def test_every_checkov_skip_gives_its_reason_here_and_in_the_docs() -> None:
    skips = list(_checkov_skips())
    assert skips, "no checkov skips found: the annotations moved?"
    documented = DOCS.read_text()
    for path, check, reason in skips:
        assert re.fullmatch(r"CKV2?_K8S_\d+", check), f"{path}: {check}"
        assert len(reason.split()) >= 5, f"{path}: {check}: say why it is skipped: {reason!r}"
        assert check in documented, f"{check} (skipped in {path}) is not explained in {DOCS}"


# ---------------------------------------------------------------------------- commands


def _commands(rendering: Rendering) -> dict[str, tuple[dict, list[str]]]:
    """Every `ripples` command line of the manifests, by what it is: (container, argv)."""
    coordinator = rendering.container("coordinator")
    return {
        "coordinator serve": (coordinator, coordinator["args"]),
        "coordinator health (readiness probe)": (
            coordinator, coordinator["readinessProbe"]["exec"]["command"][1:]),
        "worker run --agent": (rendering.container("agent"),
                               rendering.container("agent")["args"]),
        "dashboard serve": (rendering.container("dashboard"),
                            rendering.container("dashboard")["args"]),
    }


@pytest.mark.parametrize("command", ["coordinator serve", "coordinator health (readiness probe)",
                                     "worker run --agent", "dashboard serve"])
def test_commands_parse_with_the_ripples_cli(rendered: Rendering, command: str) -> None:
    container, args = _commands(rendered)[command]
    assert _is_ripples_image(container)
    if command.startswith("coordinator health"):
        assert container["readinessProbe"]["exec"]["command"][0] == "ripples"
    argv = _expand(args, container)
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            build_parser().parse_args(argv)
    except SystemExit as exit_:
        pytest.fail(f"`ripples {' '.join(argv)}` is rejected by the CLI (exit {exit_.code}): "
                    f"{errors.getvalue().strip().splitlines()[-1:]}")


def test_processes_listen_where_services_probes_and_clients_look(rendered: Rendering) -> None:
    coordinator = rendered.container("coordinator")
    serve = _options(coordinator["args"])
    ports = _ports(coordinator)
    assert ports == {"grpc": int(serve["port"]), "store": int(serve["store-port"]),
                     "metrics": int(serve["metrics-port"])}
    # Workers dial the store at --advertise-host:--store-port: the Service, same port.
    assert serve["advertise-host"] == COORDINATOR_SERVICE
    address = f"{COORDINATOR_SERVICE}:{serve['port']}"
    for component in ("agent", "dashboard"):
        assert _options(rendered.container(component)["args"])["coordinator"] == address
    health = _options(coordinator["readinessProbe"]["exec"]["command"])
    assert health["coordinator"] == f"127.0.0.1:{serve['port']}"
    assert health["tls-server-name"] == COORDINATOR_SERVICE
    for probe in ("livenessProbe", "startupProbe"):
        get = coordinator[probe]["httpGet"]
        assert get["path"] == "/healthz"
        assert _port_number(coordinator, get["port"]) == int(serve["metrics-port"])
    dashboard = rendered.container("dashboard")
    for probe in ("readinessProbe", "livenessProbe"):
        get = dashboard[probe]["httpGet"]
        assert (get["path"], _port_number(dashboard, get["port"])) == (
            "/healthz", int(_options(dashboard["args"])["port"]))
    agent = rendered.container("agent")
    first_metrics_port = int(_options(agent["args"])["metrics-port"])
    assert first_metrics_port == WORKER_METRICS_PORTS[0] == _ports(agent)["metrics"]


def test_services_reach_declared_container_ports(rendered: Rendering) -> None:
    for service in rendered.of_kind("Service"):
        name = service["metadata"]["name"]
        selector = service["spec"]["selector"]
        pods = [w["spec"]["template"] for w in rendered.workloads()
                if selector.items() <= _labels(w["spec"]["template"]).items()]
        assert len(pods) == 1, f"Service {name} selects {len(pods)} workloads"
        (container,) = pods[0]["spec"]["containers"]
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert isinstance(target, int) or target in _ports(container), (
                f"Service {name}: no container port named {target}")
            # One number on both sides: clients are told container ports (the store's
            # --store-port) and dial them at the Service; NetworkPolicies match them.
            assert _port_number(container, target) == port["port"], (name, port)


def test_coordinator_is_one_copy_with_its_state_on_a_volume(rendered: Rendering) -> None:
    deployment = rendered.get("Deployment", "ripples-coordinator")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]
    state_dir = _options(rendered.container("coordinator")["args"])["state-dir"]
    kind, source, _ = _file_source(pod, rendered.container("coordinator"), state_dir)
    assert kind == "persistentVolumeClaim", f"--state-dir={state_dir} is on {kind}"
    claim = rendered.get("PersistentVolumeClaim", source)
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]


# ---------------------------------------------------------------------------- secrets, files


def _file_source(pod: dict, container: dict, path: str) -> tuple[str, str, str]:
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


# What each process reads from which Secret key: the dashboard holds the read-only token
# only, the agents the CA but never the coordinator's key.
SECRET_FILES = {
    "coordinator": {"token-file": ("ripples-token", "token"),
                    "read-token-file": ("ripples-read-token", "token"),
                    "tls-cert": ("ripples-tls", "tls.crt"),
                    "tls-key": ("ripples-tls", "tls.key")},
    "agent": {"token-file": ("ripples-token", "token"), "tls-ca": ("ripples-tls", "ca.crt")},
    "dashboard": {"token-file": ("ripples-read-token", "token"),
                  "tls-ca": ("ripples-tls", "ca.crt")},
}


def test_processes_read_the_three_secrets_and_only_the_keys_they_need(
        rendered: Rendering) -> None:
    assert not rendered.of_kind("Secret"), "Secret values are never committed"
    mounted: set[str] = set()
    for workload in rendered.workloads():
        for volume in workload["spec"]["template"]["spec"]["volumes"]:
            if "secret" in volume:
                mounted.add(volume["secret"]["secretName"])
    assert mounted == SECRETS
    for component, expected in SECRET_FILES.items():
        pod, container = rendered.pod(component), rendered.container(component)
        options = _options(container["args"])
        files = {o: v for o, v in options.items() if v.startswith("/etc/")}
        assert files.keys() == expected.keys(), component
        for option, (secret, key) in expected.items():
            assert _file_source(pod, container, files[option]) == ("secret", secret, key), (
                f"{component} --{option}={files[option]}")
        keys = {(v["secret"]["secretName"], i["key"]) for v in pod["spec"]["volumes"]
                if "secret" in v for i in v["secret"].get("items", [])}
        whole = {v["secret"]["secretName"] for v in pod["spec"]["volumes"]
                 if "secret" in v and "items" not in v["secret"]}
        if component != "coordinator":
            assert "ripples-tls" not in whole and ("ripples-tls", "tls.key") not in keys, (
                f"{component} must not see the coordinator's TLS key")
    probe = _options(rendered.container("coordinator")["readinessProbe"]["exec"]["command"])
    assert _file_source(rendered.pod("coordinator"), rendered.container("coordinator"),
                        probe["tls-ca"]) == ("secret", "ripples-tls", "ca.crt")


def test_processes_write_only_to_volumes(rendered: Rendering) -> None:
    """Root filesystems are read-only: whatever a process writes lies on a volume."""
    writes = {"coordinator": ["state-dir"], "agent": ["output-dir"],
              "prometheus": ["storage.tsdb.path"]}
    for component, options in writes.items():
        pod, container = rendered.pod(component), rendered.container(component)
        for option in options:
            path = _options(container["args"])[option]
            kind, _, _ = _file_source(pod, container, path)
            assert kind in ("emptyDir", "persistentVolumeClaim"), f"--{option}={path}: {kind}"
    agent = rendered.container("agent")
    assert _file_source(rendered.pod("agent"), agent, agent["workingDir"])[0] == "emptyDir"
    for workload in rendered.workloads():
        pod = workload["spec"]["template"]
        (container,) = pod["spec"]["containers"]
        if container["name"] != "prometheus":  # writes its TSDB only
            assert _file_source(pod, container, "/tmp/x")[0] == "emptyDir", container["name"]


# ---------------------------------------------------------------------------- pods


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
            if _is_ripples_image(container):
                assert pod_security["runAsUser"] == RIPPLES_UID, name
                assert container["image"] == f"ripples:{version}", (
                    f"{name}: kustomization.yaml's images: newTag should be the package "
                    f"version {version}")
            else:
                assert container["image"] in compose_images, (
                    f"{name}: {container['image']} is not the version compose.yaml runs")


def test_agents_run_one_worker_per_gpu_or_two_on_cpu() -> None:
    for name in KUSTOMIZATIONS:
        rendering = _render(name)
        agents = rendering.get("DaemonSet", "ripples-agent")["spec"]["template"]["spec"]
        (container,) = agents["containers"]
        nproc = int(_options(_expand(container["args"], container))["nproc-per-node"])
        resources = container["resources"]
        # SIGTERM drains: the workers leave their groups and the run before the kill.
        assert agents["terminationGracePeriodSeconds"] >= 60
        assert _options(container["args"])["host"] == "$(NODE_NAME)"
        env = {e["name"]: e for e in container["env"]}
        assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
        # Prometheus scrapes the workers at the pod's address, not at whatever address
        # the coordinator sees their connections come from (a SNAT on the way).
        assert _options(container["args"])["metrics-host"] == "$(POD_IP)"
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


# ---------------------------------------------------------------------------- network policy


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
        pods[_labels(template)["app.kubernetes.io/component"]] = Pod(
            _labels(template), _ports(container))
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


# ---------------------------------------------------------------------------- prometheus


PROMETHEUS_CONFIG = K8S / "base" / "prometheus" / "prometheus.yml"


@needs_promtool
def test_prometheus_config_passes_promtool() -> None:
    assert PROMTOOL is not None
    # --syntax-only: the token files exist in the pod only.
    result = subprocess.run([PROMTOOL, "check", "config", "--syntax-only",
                             str(PROMETHEUS_CONFIG)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_scrapes_the_coordinator_and_workers_with_their_tokens(
        rendered: Rendering) -> None:
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    compose_config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    # Grafana's datasource timeInterval is this scrape interval (the datasource is the
    # compose stack's, below).
    assert config["global"] == compose_config["global"]
    pod, container = rendered.pod("prometheus"), rendered.container("prometheus")
    config_file = _options(container["args"])["config.file"]
    kind, name, key = _file_source(pod, container, config_file)
    assert (kind, re.sub(r"-[a-z0-9]{10}$", "", name), key) == (
        "configMap", "prometheus-config", "prometheus.yml")
    metrics_port = _options(rendered.container("coordinator")["args"])["metrics-port"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    # /sd and the coordinator's /metrics take the read-only token; a worker's /metrics
    # takes only the run's token (worker/session.py).
    expected = {"ripples": ("coordinator", "ripples-read-token"),
                "ripples-workers": ("worker", "ripples-token")}
    assert jobs.keys() == expected.keys()
    for job_name, (role, scrape_secret) in expected.items():
        job = jobs[job_name]
        (sd,) = job["http_sd_configs"]
        assert sd["url"] == f"http://{COORDINATOR_SERVICE}:{metrics_port}/sd"
        for auth, secret in ((sd["authorization"], "ripples-read-token"),
                             (job["authorization"], scrape_secret)):
            assert auth["type"] == "Bearer"
            assert _file_source(pod, container, auth["credentials_file"]) == (
                "secret", secret, "token"), job_name
        assert job["relabel_configs"] == [
            {"source_labels": ["role"], "regex": role, "action": "keep"}]


# ---------------------------------------------------------------------------- grafana


def test_grafana_mounts_what_its_provisioning_names(rendered: Rendering) -> None:
    pod, container = rendered.pod("grafana"), rendered.container("grafana")
    env = {e["name"]: e["value"] for e in container["env"]}
    compose_env = yaml.safe_load((DEPLOY / "compose.yaml").read_text())[
        "services"]["grafana"]["environment"]
    for key in ("GF_AUTH_ANONYMOUS_ENABLED", "GF_AUTH_ANONYMOUS_ORG_ROLE",
                "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"):
        assert env[key] == compose_env[key], key
    (provider,) = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards"
                                  / "ripples.yaml").read_text())["providers"]

    def config_map(path: str) -> tuple[str, str]:
        kind, name, key = _file_source(pod, container, path)
        assert kind == "configMap", path
        return re.sub(r"-[a-z0-9]{10}$", "", name), key

    home = env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert PurePosixPath(home).parent == PurePosixPath(provider["options"]["path"])
    assert config_map(home) == ("grafana-dashboards", "ripples.json")
    provisioning = "/etc/grafana/provisioning"
    assert config_map(f"{provisioning}/datasources/ripples.yaml") == (
        "grafana-datasources", "ripples.yaml")
    assert config_map(f"{provisioning}/dashboards/ripples.yaml") == (
        "grafana-dashboard-providers", "ripples.yaml")
    (datasource,) = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources"
                                    / "ripples.yaml").read_text())["datasources"]
    service = rendered.get("Service", "prometheus")
    assert datasource["url"] == f"http://prometheus:{service['spec']['ports'][0]['port']}"
