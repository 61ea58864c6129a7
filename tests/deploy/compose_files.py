"""deploy/compose.yaml as the deploy tests read it (no Docker engine runs here).

Its services and the `ripples` commands they run (compose's `${NAME:-default}` replaced by
the default), their health checks and mounts, the clients of the coordinator and the
token, CA and address each is given, and where a file that a service names lies: on a
named volume (a stand-in directory in the tests) or on a bind mount of deploy/.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

from deploy_tree import DEPLOY, load_yaml

COMPOSE = DEPLOY / "compose.yaml"
INIT_SCRIPT = DEPLOY / "compose" / "init-secrets.sh"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "ripples.yaml"

_INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def load_compose() -> dict:
    return load_yaml(COMPOSE)


def interpolate(text: str) -> str:
    """Compose's `${NAME:-default}` with the defaults (the environment left out)."""
    return _INTERPOLATION.sub(lambda m: m.group(2) or "", text)


def ripples_services(compose: dict) -> dict[str, dict]:
    """Services that run the `ripples` command (the image's entry point, not replaced)."""
    return {name: s for name, s in compose["services"].items()
            if s.get("image", "").startswith("ripples") and "entrypoint" not in s}


def service_command(service: dict) -> list[str]:
    return [interpolate(str(arg)) for arg in service["command"]]


def option_values(command: list[str]) -> dict[str, str]:
    """`--name=value` options of a command (the form compose.yaml uses throughout)."""
    return dict(arg[2:].split("=", 1) for arg in command if arg.startswith("--") and "=" in arg)


def agent_services(compose: dict) -> dict[str, dict]:
    return {n: s for n, s in ripples_services(compose).items()
            if s["command"][:3] == ["worker", "run", "--agent"]}


def health_commands(compose: dict) -> dict[str, list[str]]:
    """Each service's health check that runs `ripples`: its arguments."""
    found = {}
    for name, service in compose["services"].items():
        test = service.get("healthcheck", {}).get("test", [])
        if test[:2] == ["CMD", "ripples"]:
            found[name] = [interpolate(a) for a in test[2:]]
    return found


def mounts(service: dict) -> list[tuple[str, str]]:
    """(source, target) of each of a service's volumes (short syntax)."""
    return [tuple(v.split(":")[:2]) for v in service.get("volumes", [])]  # type: ignore[misc]


def is_bind(source: str) -> bool:
    return source.startswith((".", "/"))


def mount_target(service: dict, source: str) -> str:
    """Where a service mounts the bind source `source` (relative to deploy/)."""
    for src, target in mounts(service):
        if is_bind(src) and PurePosixPath(src) == PurePosixPath(source):
            return target
    raise AssertionError(f"{source} is not mounted: {service.get('volumes')}")


def mount_source(service: dict, path: str) -> tuple[str, str]:
    """(the volume or bind source, the path inside it) of a file a service names."""
    best: tuple[str, str] | None = None
    for src, target in mounts(service):
        if PurePosixPath(path).is_relative_to(target) and (
                best is None or len(target) > len(best[1])):
            best = (src, target)
    assert best is not None, f"{path} is on no volume of the service: {service.get('volumes')}"
    return best[0], str(PurePosixPath(path).relative_to(best[1]))


def local_file(service: dict, path: str, volumes: Path) -> Path:
    """The file a service's `path` is in this test: a named volume's stand-in under
    `volumes`, or the bind-mounted file of deploy/."""
    src, inside = mount_source(service, path)
    return (DEPLOY / src if is_bind(src) else volumes / src) / inside


def client_files(service: dict) -> dict[str, str]:
    """A client's token file and CA: its flags, else its environment (as `ripples` reads
    them)."""
    options = option_values(service_command(service))
    env = service.get("environment", {})
    return {"token": options.get("token-file", env.get("RIPPLES_TOKEN_FILE", "")),
            "ca": options.get("tls-ca", env.get("RIPPLES_TLS_CA", "")),
            "coordinator": options.get("coordinator", env.get("RIPPLES_COORDINATOR", ""))}


def client_services(compose: dict) -> dict[str, dict]:
    """Every service that calls the coordinator's gRPC service."""
    return {n: s for n, s in ripples_services(compose).items() if n != "coordinator"}


def provisioned_datasource() -> dict:
    (datasource,) = load_yaml(DATASOURCES)["datasources"]
    return datasource


def prometheus_config_file() -> Path:
    """The config file the compose Prometheus runs (its --config.file, as mounted)."""
    prometheus = load_compose()["services"]["prometheus"]
    (config,) = [a.split("=", 1)[1] for a in prometheus["command"]
                 if a.startswith("--config.file=")]
    src, inside = mount_source(prometheus, config)
    assert is_bind(src) and inside == "."
    return DEPLOY / src
