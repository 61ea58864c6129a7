"""deploy/k8s's processes read the Secret keys they should, and write only to volumes.

On the objects `kubectl kustomize` renders (tests/deploy/k8s_rendering.py), each file a
process is given is traced to the volume it lies on: the coordinator is one copy with its
state on a claim; the three Secrets are mounted, never committed, and each process reads
only its own keys (the dashboard the read-only token, no client the coordinator's TLS
key); whatever a process writes (state, output, /tmp) lies on a volume, the root
filesystems being read-only.
"""

from __future__ import annotations

from k8s_rendering import Rendering, arg_options, file_source

SECRETS = {"ripples-token", "ripples-read-token", "ripples-tls"}


def test_coordinator_is_one_copy_with_its_state_on_a_volume(rendered: Rendering) -> None:
    deployment = rendered.get("Deployment", "ripples-coordinator")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]
    state_dir = arg_options(rendered.container("coordinator")["args"])["state-dir"]
    kind, source, _ = file_source(pod, rendered.container("coordinator"), state_dir)
    assert kind == "persistentVolumeClaim", f"--state-dir={state_dir} is on {kind}"
    claim = rendered.get("PersistentVolumeClaim", source)
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]


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
        options = arg_options(container["args"])
        files = {o: v for o, v in options.items() if v.startswith("/etc/")}
        assert files.keys() == expected.keys(), component
        for option, (secret, key) in expected.items():
            assert file_source(pod, container, files[option]) == ("secret", secret, key), (
                f"{component} --{option}={files[option]}")
        keys = {(v["secret"]["secretName"], i["key"]) for v in pod["spec"]["volumes"]
                if "secret" in v for i in v["secret"].get("items", [])}
        whole = {v["secret"]["secretName"] for v in pod["spec"]["volumes"]
                 if "secret" in v and "items" not in v["secret"]}
        if component != "coordinator":
            assert "ripples-tls" not in whole and ("ripples-tls", "tls.key") not in keys, (
                f"{component} must not see the coordinator's TLS key")
    probe = arg_options(rendered.container("coordinator")["readinessProbe"]["exec"]["command"])
    assert file_source(rendered.pod("coordinator"), rendered.container("coordinator"),
                        probe["tls-ca"]) == ("secret", "ripples-tls", "ca.crt")


def test_processes_write_only_to_volumes(rendered: Rendering) -> None:
    """Root filesystems are read-only: whatever a process writes lies on a volume."""
    writes = {"coordinator": ["state-dir"], "agent": ["output-dir"],
              "prometheus": ["storage.tsdb.path"]}
    for component, options in writes.items():
        pod, container = rendered.pod(component), rendered.container(component)
        for option in options:
            path = arg_options(container["args"])[option]
            kind, _, _ = file_source(pod, container, path)
            assert kind in ("emptyDir", "persistentVolumeClaim"), f"--{option}={path}: {kind}"
    agent = rendered.container("agent")
    assert file_source(rendered.pod("agent"), agent, agent["workingDir"])[0] == "emptyDir"
    for workload in rendered.workloads():
        pod = workload["spec"]["template"]
        (container,) = pod["spec"]["containers"]
        if container["name"] != "prometheus":  # writes its TSDB only
            assert file_source(pod, container, "/tmp/x")[0] == "emptyDir", container["name"]
