"""deploy/k8s renders the whole stack, is valid Kubernetes, and passes checkov.

Real tools, no cluster: `kubectl kustomize` renders the base and the CPU overlay (Debian
package kubectl; the tests that need it skip without it), kubernetes-validate checks every
rendered object against the Kubernetes API's schema (strict: no unknown field), and
checkov runs its Kubernetes checks on the rendered manifests (from a venv of its own under
pytest's cache: its pins would downgrade packages of this project's venv); every checkov
skip gives its reason in its annotation and in docs/kubernetes.md. The test_k8s_*.py
modules beside this one check what the rendered objects say.
"""

from __future__ import annotations

import fcntl
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from deploy_tree import REPO
from k8s_rendering import K8S, KUSTOMIZATIONS, Rendering, labels, render

DOCS = REPO / "docs" / "kubernetes.md"

KUBERNETES_VERSIONS = ("1.30", "1.37")
"""Schemas the rendered objects must satisfy: an old and the newest release that
kubernetes-validate's wheel ships (offline)."""
CHECKOV_VERSION = "3.3.30"

NAMESPACE = "ripples"


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
        assert labels(obj).get("app.kubernetes.io/part-of") == "ripples", (
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


@pytest.fixture(scope="session")
def checkov(pytestconfig: pytest.Config) -> Path:
    """checkov, pinned, in a venv of its own under pytest's cache (made on first use):
    installed into this project's venv it would downgrade packaging, networkx and
    python-dateutil. A lock beside the venv makes a second pytest process (another
    session, an xdist worker) wait for the first one's install instead of clearing it."""
    cache = getattr(pytestconfig, "cache", None)  # absent with -p no:cacheprovider
    if cache is None:
        pytest.skip("checkov lives in pytest's cache: run without -p no:cacheprovider")
    venv = cache.mkdir(f"checkov-{CHECKOV_VERSION}")
    installed = venv / ".installed"
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, skip or not
        if not installed.exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True,
                           capture_output=True, timeout=120)
            result = subprocess.run(
                [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                 "--disable-pip-version-check", f"checkov=={CHECKOV_VERSION}"],
                capture_output=True, text=True, timeout=600)
            if result.returncode != 0:
                pytest.skip(f"could not install checkov=={CHECKOV_VERSION} into {venv} (is "
                            f"the package index reachable?): {result.stderr.strip()[-400:]}")
            installed.touch()
    return venv / "bin" / "checkov"


@pytest.mark.timeout(900)  # the first run installs checkov
def test_checkov_finds_no_failure_that_is_not_skipped_with_a_reason(
        checkov: Path, tmp_path: Path) -> None:
    for name in KUSTOMIZATIONS:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump_all(render(name).objects, sort_keys=False))
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
