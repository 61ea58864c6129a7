"""On a cluster (a coordinator and `ripples worker run` processes, no `ripples run` to
average their files), the live workers average once more after the stop: every worker's
saved final model is the consensus model."""

from __future__ import annotations

import pytest
import torch

from tests.integration.helpers import running_coordinator, start_worker

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("protocol", ["ripples-smart", "adpsgd"])
def test_every_workers_final_model_is_the_consensus(protocol: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with running_coordinator(protocol=protocol, num_workers=3, task="digits",
                             iterations=150, seed=3) as server:
        workers = [start_worker(server.address, "--host", f"node{r}", "--metrics-port", "-1",
                                "--save-model", str(tmp_path / f"w{r}.pt"))
                   for r in range(3)]
        outputs = []
        try:
            for p in workers:
                out, _ = p.communicate(timeout=180)
                outputs.append(out)
                assert p.returncode == 0, out[-3000:]
        finally:
            for p in workers:
                if p.poll() is None:
                    p.kill()
    states = [torch.load(tmp_path / f"w{r}.pt") for r in range(3)]
    for name, tensor in states[0].items():
        if tensor.is_floating_point():
            for other in states[1:]:
                torch.testing.assert_close(other[name], tensor, rtol=1e-5, atol=1e-6)
    assert all("final average over workers" in out for out in outputs), outputs[0][-2000:]
