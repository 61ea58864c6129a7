"""The Grafana dashboard's queries as PromQL a plain Prometheus accepts.

Grafana expands its variables before it sends a query; tests that hand the dashboard's
expressions to promtool or to a real Prometheus do the same here: `$__rate_interval` (and
`$__interval`, `$__range`) become a fixed duration, and a template variable becomes its
"All" value.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DASHBOARD_PATH = REPO / "deploy" / "grafana" / "dashboards" / "ripples.json"

_VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")


@dataclass(frozen=True, kw_only=True)
class PanelQuery:
    """One target of one panel."""

    panel: str
    ref_id: str
    expr: str
    """As written in the dashboard, Grafana variables included."""

    def __str__(self) -> str:
        return f"panel {self.panel!r} target {self.ref_id}: {self.expr}"


def load_dashboard(path: Path = DASHBOARD_PATH) -> dict:
    with open(path) as f:
        return json.load(f)


def panels(dashboard: dict) -> list[dict]:
    """Every panel, rows included, and the panels nested in collapsed rows."""
    found: list[dict] = []
    for panel in dashboard.get("panels", []):
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def queries(dashboard: dict) -> list[PanelQuery]:
    return [PanelQuery(panel=p.get("title", f"#{p.get('id')}"), ref_id=t.get("refId", "?"),
                       expr=t["expr"])
            for p in panels(dashboard) for t in p.get("targets", []) if t.get("expr")]


def template_variables(dashboard: dict) -> list[dict]:
    return list(dashboard.get("templating", {}).get("list", []))


def to_promql(expr: str, dashboard: dict, *, rate_interval: str = "10s") -> str:
    """`expr` with Grafana's variables replaced; ValueError names one it cannot replace."""
    builtin = {"__rate_interval": rate_interval, "__interval": rate_interval,
               "__range": "5m"}
    variables = {v["name"]: v.get("allValue") for v in template_variables(dashboard)}

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name in builtin:
            return builtin[name]
        if variables.get(name):
            return str(variables[name])
        raise ValueError(f"no test value for Grafana variable ${name} in {expr!r}: give the "
                         "template variable an allValue, or add the variable here")

    return _VARIABLE.sub(replace, expr)
