"""Fixtures of the deploy tests: the k8s test modules' renderings of deploy/k8s."""

from __future__ import annotations

import pytest
from k8s_rendering import KUSTOMIZATIONS, Rendering, render


@pytest.fixture(params=sorted(KUSTOMIZATIONS))
def rendered(request: pytest.FixtureRequest) -> Rendering:
    """Each kustomization (the base and the CPU overlay), rendered once per session."""
    return render(request.param)
