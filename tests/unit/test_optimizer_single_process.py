"""ripples.Optimizer without a coordinator (single-process mode): the plain step, and the
torch.optim contract it keeps (schedulers, GradScaler, state_dict, autocast)."""

from __future__ import annotations

import contextlib
import copy
import math
import pickle
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import ripples
from ripples.worker.api import current_worker
from ripples.worker.launch_env import LaunchEnv


@pytest.fixture(autouse=True)
def alone() -> Iterator[None]:
    """Every test starts single-process (whatever the environment says) and leaves no
    worker behind."""
    ripples.init(env=LaunchEnv(host="test"))
    yield
    worker = current_worker()
    if worker is not None:
        worker.shutdown()


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    losses = []
    for i in range(steps):
        x, y = _batch(i)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_the_step_is_the_plain_step_bit_for_bit() -> None:
    worker = ripples.init()
    assert not worker.is_distributed and (worker.rank, worker.num_workers) == (0, 1)
    plain_model = _model()
    wrapped_model = copy.deepcopy(plain_model)
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.1, momentum=0.9)
    wrapped = ripples.Optimizer(torch.optim.SGD(wrapped_model.parameters(), lr=0.1,
                                                momentum=0.9), wrapped_model)
    assert _train(plain_model, plain, 5) == _train(wrapped_model, wrapped, 5)
    for p, q in zip(plain_model.state_dict().values(), wrapped_model.state_dict().values(),
                    strict=True):
        assert torch.equal(p, q)
    assert wrapped.local_step == wrapped.global_step == 5 and not wrapped.stopped


def test_schedulers_drive_the_wrapped_learning_rate() -> None:
    model = _model()
    opt = ripples.Optimizer(torch.optim.SGD(model.parameters(), lr=1.0), model)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0 / (1 + opt.global_step))
    for _ in range(4):
        _train(model, opt, 1)
        schedule.step()
    assert opt.param_groups is opt.optimizer.param_groups
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(1 / 5)
    steps = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(4):
        _train(model, opt, 1)
        steps.step()
    assert steps.get_last_lr()[0] == pytest.approx(1 / 5 * 0.25)


def test_state_dict_round_trips_and_loads_into_a_plain_optimizer() -> None:
    model = _model()
    opt = ripples.Optimizer(torch.optim.Adam(model.parameters(), lr=0.01), model)
    _train(model, opt, 3)
    state = opt.state_dict()
    assert state["ripples"]["local_step"] == 3
    plain = torch.optim.Adam(model.parameters(), lr=0.01)
    plain.load_state_dict(state)  # the extra key is ignored
    assert int(plain.state[next(model.parameters())]["step"]) == 3
    opt.load_state_dict(state)
    assert opt.local_step == 3


def test_step_hooks_run_around_the_whole_step_and_the_state_stays_shared() -> None:
    model = _model()
    opt = ripples.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)
    seen: list[tuple[str, int]] = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(("pre", o.local_step)))
    post = opt.register_step_post_hook(
        lambda o, args, kwargs: seen.append(("post", o.local_step)))
    _train(model, opt, 2)
    post.remove()
    _train(model, opt, 1)
    assert seen == [("pre", 0), ("post", 1), ("pre", 1), ("post", 2), ("pre", 2)]
    momentum = opt.state[next(model.parameters())]["momentum_buffer"]
    opt.optimizer.load_state_dict(opt.state_dict())  # replaces its param_groups and state
    assert opt.param_groups is opt.optimizer.param_groups
    assert opt.state is opt.optimizer.state
    assert torch.equal(opt.state[next(model.parameters())]["momentum_buffer"], momentum)
    opt.param_groups[0]["lr"] = 0.05  # what a scheduler does, after a resume too
    assert opt.optimizer.param_groups[0]["lr"] == 0.05


def test_non_finite_gradients_are_skipped_when_asked() -> None:
    model = _model()
    opt = ripples.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                            on_nonfinite="skip")
    _train(model, opt, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = _batch(9)
    opt.zero_grad()
    (nn.functional.cross_entropy(model(x), y) * float("nan")).backward()
    opt.step()
    assert opt.skipped_steps == 1 and opt.local_step == 3
    params = [k for k, _ in model.named_parameters()]
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in params)
    assert all(math.isfinite(v) for v in _train(model, opt, 2))


def test_grad_scaler_skips_overflowing_steps_and_unscales_the_others() -> None:
    plain_model, model = _model(), _model()
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.1)
    opt = ripples.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0) for _ in range(2)]
    for i in range(6):
        x, y = _batch(i)
        overflow = float("inf") if i in (1, 4) else 1.0  # these steps' gradients overflow
        for m, o, scaler in ((plain_model, plain, scalers[0]), (model, opt, scalers[1])):
            o.zero_grad()
            scaler.scale(nn.functional.cross_entropy(m(x), y) * overflow).backward()
            if i == 3:  # the usual clipping recipe: unscale first, then clip, then step
                scaler.unscale_(o)
                nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            scaler.step(o)
            scaler.update()
    assert scalers[1].get_scale() == scalers[0].get_scale() == 256.0
    assert opt.skipped_steps == 2 and opt.local_step == 6
    for p, q in zip(plain_model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_bf16_autocast_on_cpu_trains() -> None:
    model = _model()
    opt = ripples.Optimizer(torch.optim.AdamW(model.parameters(), lr=0.01), model)
    losses = []
    for i in range(30):
        x, y = _batch(i % 3)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.report_loss(loss)
        losses.append(loss.item())
    assert next(model.parameters()).dtype == torch.float32
    assert sum(losses[-3:]) < sum(losses[:3])


def test_a_planned_budget_stops_the_loop() -> None:
    model = _model()
    opt = ripples.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                            planned_steps=3)
    _train(model, opt, 3)
    assert opt.stopped and "budget" in opt.stop_reason


def test_misuse_is_refused_with_what_to_do() -> None:
    model, other = _model(), _model()
    with pytest.raises(ValueError, match="not parameters of the model"):
        ripples.Optimizer(torch.optim.SGD(other.parameters(), lr=0.1), model)
    with pytest.raises(TypeError, match="wraps a torch.optim.Optimizer"):
        ripples.Optimizer(model, model)  # type: ignore[arg-type]
    opt = ripples.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    with pytest.raises(ValueError, match="already a ripples.Optimizer"):
        ripples.Optimizer(opt, model)
    with pytest.raises(ValueError, match="one ripples.Optimizer per process"):
        ripples.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    with pytest.raises(NotImplementedError, match="add every parameter group"):
        opt.add_param_group({"params": []})
    with pytest.raises(ValueError, match="on_nonfinite"):
        ripples.Optimizer(torch.optim.SGD(other.parameters(), lr=0.1), other,
                          on_nonfinite="ignore")  # type: ignore[arg-type]


def test_an_explicit_worker_must_be_this_process_s_live_one() -> None:
    model = _model()
    worker = ripples.init()
    with pytest.raises(TypeError, match="the ripples.Worker that ripples.init"):
        ripples.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                          worker="local")  # type: ignore[arg-type]
    stranger = ripples.Worker(LaunchEnv(host="test"), None)
    with pytest.raises(ValueError, match="not this process's worker: pass the worker "
                                         r"ripples.init\(\) returns"):
        ripples.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, worker=stranger)
    opt = ripples.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, worker=worker)
    assert opt.worker is worker and worker._optimizer is opt
    _train(model, opt, 2)
    assert opt.local_step == 2
    worker.shutdown()
    with pytest.raises(ValueError, match="has shut down: pass the worker ripples.init"):
        ripples.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, worker=worker)
    fresh = ripples.init(env=LaunchEnv(host="test"))
    again = ripples.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, worker=fresh)
    assert again.worker is fresh is current_worker()


def test_the_sampler_shards_and_deals_fixed_or_per_epoch() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(10))
    shards = [list(ripples.DistributedSampler(data, num_replicas=3, rank=r, seed=1))
              for r in range(3)]
    assert all(len(s) == 4 for s in shards)  # padded to equal length
    assert set().union(*map(set, shards)) == set(range(10))
    moving = ripples.DistributedSampler(data, num_replicas=2, rank=0, seed=1)
    fixed = ripples.DistributedSampler(data, num_replicas=2, rank=0, seed=1,
                                       reshard_every_epoch=False)
    epochs_moving, epochs_fixed = [], []
    for epoch in range(4):
        moving.set_epoch(epoch)
        fixed.set_epoch(epoch)
        epochs_moving.append(list(moving))
        epochs_fixed.append(list(fixed))
    assert len({frozenset(e) for e in epochs_fixed}) == 1  # one shard, reshuffled
    assert len({tuple(e) for e in epochs_fixed}) > 1
    assert len({frozenset(e) for e in epochs_moving}) > 1  # re-dealt every epoch
    assert ripples.DistributedSampler(data).num_replicas == 1  # single-process: everything


def test_a_ddp_script_s_gradient_accumulation_runs_alone() -> None:
    """DDP's spellings (`with model.no_sync():`, `model.require_backward_grad_sync`) are
    no-ops alone; the model still deep-copies and pickles (an EMA copy, torch.save), and
    a model that defines its own `no_sync` keeps it."""
    model = _model()
    opt = ripples.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    x, y = _batch(0)
    for micro in range(3):
        model.require_backward_grad_sync = micro == 2
        with model.no_sync():  # type: ignore[operator]
            nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    twin = copy.deepcopy(model)
    with twin.no_sync():  # type: ignore[operator]
        pass
    restored = pickle.loads(pickle.dumps(model))
    assert restored.no_sync is contextlib.nullcontext

    class OwnNoSync(nn.Linear):
        def no_sync(self) -> str:
            return "mine"

    worker = current_worker()
    assert worker is not None
    worker.shutdown()
    ripples.init(env=LaunchEnv(host="test"))
    own = OwnNoSync(3, 3)
    ripples.Optimizer(torch.optim.SGD(own.parameters(), lr=0.1), own)
    assert own.no_sync() == "mine"
