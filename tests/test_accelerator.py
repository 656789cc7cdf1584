"""Accelerator: equivalence with one process, gradient accumulation, DDP syncs, metrics gathering, precision.

Every Accelerator lives in a child process (run_ranks), so the state singletons never leak between tests.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # noqa: F401  DDP's constructor imports it (seconds); forked ranks inherit it
from ranks_helper import run_ranks

N_FEATURES = 6


def _data(n: int = 64) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, N_FEATURES, generator=gen)
    y = x @ torch.arange(1.0, N_FEATURES + 1) + 0.1 * torch.randn(n, generator=gen)
    return torch.utils.data.TensorDataset(x, y[:, None])


def _model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(N_FEATURES, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _reference_weights(batch_size: int, epochs: int = 2) -> list[torch.Tensor]:
    """Plain single-process SGD: what every prepared variant must reproduce."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(_data(), batch_size=batch_size)
    for _ in range(epochs):
        for x, y in loader:
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _train(batch_size: int, epochs: int = 2, accumulation: int = 1, **accelerator_kwargs):
    from nbaccel import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=accumulation, **accelerator_kwargs)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(_data(), batch_size=batch_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for _ in range(epochs):
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
    return [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]


def test_two_processes_batch_8_equal_one_process_batch_16():
    expected = _reference_weights(16)
    results = run_ranks(lambda rank: _train(8))
    for weights in results:
        for got, want in zip(weights, expected):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_accumulating_4_batches_of_4_equals_batch_16():
    expected = _reference_weights(16)
    (weights,) = run_ranks(lambda rank: _train(4, accumulation=4), world_size=1)
    for got, want in zip(weights, expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_accumulate_skips_ddp_allreduce_except_on_sync_steps():
    def body(rank):
        from nbaccel import Accelerator

        accelerator = Accelerator(gradient_accumulation_steps=2)
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        # 40 samples, batch 4, 2 ranks: 5 batches per rank; sync on steps 2, 4 and at the end (5).
        loader = torch.utils.data.DataLoader(_data(40), batch_size=4)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
        assert accelerator.prepare(model) is model  # preparing twice does not nest DDP
        seen = []
        for x, y in loader:
            with accelerator.accumulate(model):
                requires_sync = model.require_backward_grad_sync
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                grad = next(model.parameters()).grad.clone()
                seen.append((accelerator.sync_gradients, requires_sync, grad))
                optimizer.step()
                optimizer.zero_grad()
        return seen

    results = run_ranks(body)
    flags = [(sync, req) for sync, req, _ in results[0]]
    assert flags == [(False, False), (True, True), (False, False), (True, True), (True, True)]
    for step, ((_, _, g0), (_, _, g1)) in enumerate(zip(results[0], results[1])):
        if flags[step][0]:
            torch.testing.assert_close(g0, g1)  # all-reduced: identical on both ranks
        else:
            assert not torch.allclose(g0, g1)  # local gradients only


@pytest.mark.parametrize("size", [13, 16, 3])
def test_gather_for_metrics_returns_exactly_the_dataset(size):
    def body(rank):
        from nbaccel import Accelerator

        accelerator = Accelerator()
        dataset = torch.utils.data.TensorDataset(torch.arange(size))
        loader = accelerator.prepare(torch.utils.data.DataLoader(dataset, batch_size=4))
        tensors, objects = [], []
        for (batch,) in loader:
            tensors.append(accelerator.gather_for_metrics(batch))
            objects.extend(accelerator.gather_for_metrics([f"s{int(i)}" for i in batch]))
        return torch.cat(tensors).tolist(), objects

    for values, objects in run_ranks(body):
        assert sorted(values) == list(range(size))
        assert sorted(objects) == sorted(f"s{i}" for i in range(size))


def test_scheduler_steps_per_process_and_only_on_sync_steps():
    def body(rank):
        from nbaccel import Accelerator

        accelerator = Accelerator(gradient_accumulation_steps=2)
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        loader = torch.utils.data.DataLoader(_data(32), batch_size=4)  # 4 batches per rank
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        return scheduler.scheduler.last_epoch

    # 2 optimizer steps x 2 processes (accumulation steps move only _step_count).
    assert run_ranks(body) == [4, 4]


def test_bf16_autocast_trains_on_cpu():
    def body(rank):
        from nbaccel import Accelerator

        accelerator = Accelerator(mixed_precision="bf16", cpu=True)
        model = _model()
        inner_dtypes = []
        model[0].register_forward_hook(lambda m, i, o: inner_dtypes.append(o.dtype))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        loader = torch.utils.data.DataLoader(_data(), batch_size=16)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        losses = []
        for _ in range(5):
            for x, y in loader:
                out = model(x)
                loss = torch.nn.functional.mse_loss(out, y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
        trained_dtypes = set(inner_dtypes)
        with accelerator.autocast():
            inside = torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype
        plain = accelerator.unwrap_model(model, keep_fp32_wrapper=False)(torch.ones(1, N_FEATURES)).dtype
        return out.dtype, trained_dtypes, losses[0], losses[-1], inside, plain, accelerator.scaler

    out_dtype, inner, first, last, inside, plain, scaler = run_ranks(body, world_size=1)[0]
    assert out_dtype == torch.float32  # outputs converted back to fp32
    assert inner == {torch.bfloat16}
    assert last < first
    assert inside == torch.bfloat16 and plain == torch.float32
    assert scaler is None


def test_unscale_gradients_works_on_any_step_as_in_accelerate():
    """Accelerate unscales whenever fp16 has a GradScaler, synchronizing step or not (accelerator.py,
    `unscale_gradients`); it cannot run this here: on a CPU it trains fp16 without a scaler (docs/compat.md).
    So a clip inside an accumulation sees the true gradients, and a second unscale before the optimizer's
    step is GradScaler's RuntimeError, on both."""

    def body(rank):
        from nbaccel import Accelerator, GradScalerKwargs

        accelerator = Accelerator(mixed_precision="fp16", cpu=True, gradient_accumulation_steps=2,
                                  kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
        model = _model()
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
        x, y = next(iter(torch.utils.data.DataLoader(_data(), batch_size=16)))
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            scaled = [p.grad.clone() for p in model.parameters()]
            accelerator.unscale_gradients()
            unscaled = [p.grad.clone() for p in model.parameters()]
            try:
                accelerator.unscale_gradients()
                again = "no error"
            except RuntimeError as exc:
                again = str(exc)
        return accelerator.sync_gradients, all(torch.allclose(u * 1024, s) for u, s in zip(unscaled, scaled)), again

    sync, divided, again = run_ranks(body, world_size=1)[0]
    assert sync is False and divided and "unscale_() has already been called" in again


def test_fp16_with_grad_scaler_on_cpu_skips_overflowing_steps():
    def body(rank):
        from nbaccel import Accelerator, GradScalerKwargs

        accelerator = Accelerator(mixed_precision="fp16", cpu=True,
                                  kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        loader = torch.utils.data.DataLoader(_data(), batch_size=16)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        assert isinstance(accelerator.scaler, torch.amp.GradScaler)
        losses = []
        for _ in range(5):
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(model.parameters(), 10.0)
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
        skipped_before = accelerator.optimizer_step_was_skipped
        before = [p.detach().clone() for p in model.parameters()]
        x, y = next(iter(loader))
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y) * float("inf"))
        optimizer.step()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        return losses[0], losses[-1], skipped_before, accelerator.optimizer_step_was_skipped, unchanged

    first, last, skipped_before, skipped_after, unchanged = run_ranks(body, world_size=1)[0]
    assert last < first
    assert not skipped_before and skipped_after and unchanged


def test_fp8_without_a_backend_names_what_to_install():
    import importlib.util

    if any(importlib.util.find_spec(m) for m in ("transformer_engine", "torchao", "msamp")):
        pytest.skip("an fp8 backend is installed")

    def body(rank):
        from nbaccel import Accelerator

        try:
            Accelerator(mixed_precision="fp8")
        except ImportError as error:
            return str(error)
        return "no error"

    message = run_ranks(body, world_size=1)[0]
    assert "torchao" in message and "transformer_engine" in message


def test_bad_arguments_are_named():
    def body(rank):
        from nbaccel import Accelerator

        errors = []
        for kwargs in ({"mixed_precision": "fp12"}, {"gradient_accumulation_steps": 0},
                       {"rng_types": ["dice"]}, {"dynamo_backend": "warp"}, {"fsdp_plugin": object()},
                       {"log_with": "carrier_pigeon"}):
            try:
                Accelerator(**kwargs)
            except (ValueError, TypeError) as error:
                errors.append(str(error))
        return errors

    errors = run_ranks(body, world_size=1)[0]
    assert len(errors) == 6
    words = ["fp12", "gradient_accumulation_steps", "dice", "warp", "fsdp_plugin", "carrier_pigeon"]
    for word, message in zip(words, errors):
        assert word in message


def test_properties_processes_and_triggers():
    def body(rank):
        from nbaccel import Accelerator

        accelerator = Accelerator()
        seen = []
        accelerator.on_main_process(lambda: seen.append("main"))()
        accelerator.on_last_process(lambda: seen.append("last"))()
        if rank == 1:
            accelerator.set_trigger()
        triggered = accelerator.check_trigger()
        again = accelerator.check_trigger()
        with accelerator.split_between_processes(list(range(5))) as part:
            mine = part
        reduced = accelerator.reduce(torch.tensor([float(rank + 1)]))
        padded = accelerator.pad_across_processes(torch.ones(rank + 1))
        return dict(
            index=accelerator.process_index, n=accelerator.num_processes, main=accelerator.is_main_process,
            last=accelerator.is_last_process, device=str(accelerator.device),
            type=str(accelerator.distributed_type), seen=seen, triggered=triggered, again=again, mine=mine,
            reduced=reduced.tolist(), padded=padded.shape[0], mp=accelerator.mixed_precision,
            sync=accelerator.sync_gradients, steps=accelerator.gradient_accumulation_steps,
        )

    r0, r1 = run_ranks(body)
    assert (r0["index"], r1["index"], r0["n"]) == (0, 1, 2)
    assert r0["main"] and not r1["main"] and r1["last"]
    assert r0["device"] == "cpu" and r0["type"] == "DistributedType.MULTI_CPU"
    assert r0["seen"] == ["main"] and r1["seen"] == ["last"]
    assert r0["triggered"] and r1["triggered"] and not r0["again"]
    assert r0["mine"] + r1["mine"] == [0, 1, 2, 3, 4]
    assert r0["reduced"] == [3.0] and r0["padded"] == 2 == r1["padded"]
    assert r0["mp"] == "no" and r0["sync"] and r0["steps"] == 1


def test_split_batches_two_processes_equal_one_process():
    def body(rank):
        from nbaccel import DataLoaderConfiguration

        return _train(16, dataloader_config=DataLoaderConfiguration(split_batches=True))

    expected = _reference_weights(16)
    for weights in run_ranks(body):
        for got, want in zip(weights, expected):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_compile_unwrap_lomo_and_telemetry():
    def body(rank):
        from nbaccel import Accelerator, telemetry

        messages = []
        telemetry.attach(messages.append, rank)
        accelerator = Accelerator(dynamo_backend="eager")
        model = _model()
        prepared = accelerator.prepare(model)
        compiled = isinstance(prepared, torch._dynamo.eval_frame.OptimizedModule)
        plain = accelerator.unwrap_model(prepared, keep_torch_compile=False) is model
        optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
        accelerator.prepare(torch.utils.data.DataLoader(_data(32), batch_size=8))
        model(torch.ones(1, N_FEATURES)).sum().backward()
        optimizer.step()
        optimizer.step()
        try:
            accelerator.lomo_backward(torch.ones(()), 0.1)
            lomo = "no error"
        except ImportError as error:
            lomo = str(error)
        telemetry.detach()
        kinds = [(m["kind"], m.get("step", m.get("total"))) for m in messages if m["kind"] in ("step", "total")]
        return compiled, plain, lomo, kinds

    compiled, plain, lomo, kinds = run_ranks(body, world_size=1)[0]
    assert compiled and plain
    assert "lomo-optim" in lomo
    # Steps outside any data loader: no epoch position. Preparing a loader announces no run length.
    assert kinds == [("step", 1), ("step", 2)]


def test_steps_report_where_the_training_loader_is_whatever_was_prepared_after_it():
    def body(rank):
        from nbaccel import Accelerator, telemetry

        messages = []
        telemetry.attach(messages.append, rank)
        accelerator = Accelerator(gradient_accumulation_steps=2)
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        train = torch.utils.data.DataLoader(_data(64), batch_size=8)  # 4 batches per rank
        evaluation = torch.utils.data.DataLoader(_data(16), batch_size=8)  # 1 batch per rank, prepared last
        model, optimizer, train, evaluation = accelerator.prepare(model, optimizer, train, evaluation)

        def epoch(loader):
            for x, y in loader:
                with accelerator.accumulate(model):
                    accelerator.backward(torch.nn.functional.mse_loss(model(x).squeeze(-1), y))
                    optimizer.step()
                    optimizer.zero_grad()
            for x, _ in evaluation:
                model(x)

        epoch(train)
        epoch(train)
        epoch(accelerator.skip_first_batches(train, 2))  # a resumed epoch: the first 2 batches left out
        telemetry.detach()
        return [(m["step"], m.get("epoch"), m.get("batch"), m.get("batches")) for m in messages if m["kind"] == "step"]

    for steps in run_ranks(body, world_size=2):
        # one optimizer step per 2 batches; (step, epoch from 0, batches of the epoch done, the epoch's batches)
        assert steps == [(1, 0, 2, 4), (2, 0, 4, 4), (3, 1, 2, 4), (4, 1, 4, 4), (5, 2, 4, 4)]


def test_join_uneven_inputs_lets_processes_run_out_of_data():
    def body(rank):
        from nbaccel import Accelerator

        accelerator = Accelerator()
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        loader = torch.utils.data.DataLoader(_data(20), batch_size=4)  # 5 batches: 3 for rank 0, 2 for rank 1
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        steps = 0
        with accelerator.join_uneven_inputs([model], even_batches=False):
            for x, y in loader:
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
                steps += 1
        return steps, accelerator.even_batches, len(list(loader))

    assert run_ranks(body, timeout=30) == [(3, True, 3), (2, True, 3)]


def test_config_file_reaches_the_accelerator_only_through_a_launcher(tmp_path):
    """As in Accelerate (issue 14 item 6): the file is applied by launchers, through the environment."""
    config = tmp_path / "config.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nmixed_precision: bf16\n")

    def body(rank):
        import os

        from nbaccel import Accelerator
        from nbaccel.state import AcceleratorState

        seen = [Accelerator().mixed_precision]
        AcceleratorState._reset_state(True)
        seen.append(Accelerator(mixed_precision="no").mixed_precision)
        AcceleratorState._reset_state(True)
        os.environ["NBACCEL_MIXED_PRECISION"] = "fp16"
        seen.append(Accelerator(cpu=True).mixed_precision)
        return seen

    assert run_ranks(body, world_size=1, env={"NBACCEL_CONFIG_FILE": str(config)})[0] == ["no", "no", "fp16"]


def test_gradient_accumulation_steps_from_the_launcher_override_the_argument():
    def body(rank):
        import os

        import pytest

        from nbaccel import Accelerator
        from nbaccel.state import AcceleratorState

        seen = [Accelerator(gradient_accumulation_steps=2).gradient_accumulation_steps]
        AcceleratorState._reset_state(True)
        os.environ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = "4"  # what Accelerate's launcher sets
        seen.append(Accelerator(gradient_accumulation_steps=2).gradient_accumulation_steps)
        AcceleratorState._reset_state(True)
        os.environ["NBACCEL_GRADIENT_ACCUMULATION_STEPS"] = "three"
        with pytest.raises(ValueError, match="NBACCEL_GRADIENT_ACCUMULATION_STEPS"):
            Accelerator()
        return seen

    assert run_ranks(body, world_size=1)[0] == [2, 4]


def _train_with(package: str, mixed_precision: str):
    def body(rank):
        import importlib

        accelerator = importlib.import_module(package).Accelerator(
            gradient_accumulation_steps=2, cpu=True, mixed_precision=mixed_precision)
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        loader = torch.utils.data.DataLoader(_data(44), batch_size=4)  # 11 batches: padding, uneven accumulation
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        lrs = []
        for _ in range(2):
            for x, y in loader:
                with accelerator.accumulate(model):
                    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                    lrs.append(scheduler.get_last_lr()[0])
        return [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()], lrs

    return body


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])  # Accelerate uses no GradScaler on CPU
def test_same_weights_and_schedule_as_accelerate(mixed_precision):
    pytest.importorskip("accelerate")
    ours = run_ranks(_train_with("nbaccel", mixed_precision))
    theirs = run_ranks(_train_with("accelerate", mixed_precision))
    for (weights, lrs), (their_weights, their_lrs) in zip(ours, theirs):
        assert lrs == their_lrs
        for got, want in zip(weights, their_weights):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_no_sync_then_trigger_sync_in_backward():
    def body(rank):
        from nbaccel import Accelerator

        accelerator = Accelerator()
        model = accelerator.prepare(_model())
        x = torch.full((4, N_FEATURES), float(rank + 1))
        with accelerator.no_sync(model):
            loss_a = model(x).sum()
            loss_b = model(2 * x).sum()
        accelerator.backward(loss_a)
        local = next(model.parameters()).grad.clone()
        with accelerator.trigger_sync_in_backward(model):
            accelerator.backward(loss_b)
        return local, next(model.parameters()).grad.clone()

    (local0, synced0), (local1, synced1) = run_ranks(body)
    assert not torch.allclose(local0, local1)  # no all-reduce in the first backward
    torch.testing.assert_close(synced0, synced1)  # the triggered one averaged everything


def test_register_for_checkpointing_names_the_items_without_state_dict_like_accelerate():
    """The ValueError names each object that lacks state_dict/load_state_dict by its index, in the words
    Accelerate's own test_state_checkpointing matches ("Item at index 0")."""
    accelerate = pytest.importorskip("accelerate")
    import nbaccel

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for library in (accelerate, nbaccel):
        library.state.AcceleratorState._reset_state(True)
        accelerator = library.Accelerator(cpu=True)
        with pytest.raises(ValueError) as info:
            accelerator.register_for_checkpointing(torch.ones(1), torch.zeros(1), model, optimizer)
        message = str(info.value)
        assert "Item at index 0" in message and "Item at index 1" in message and "index 2" not in message
        library.state.AcceleratorState._reset_state(True)


@pytest.mark.parametrize("multi_backend,xpu", [(False, False), (True, False), (True, True)])
def test_8bit_model_on_cpu_is_refused_unless_bitsandbytes_trains_on_cpu(multi_backend: bool, xpu: bool):
    """An 8-bit model placed on the CPU: refused with "CPU or disk offload", unless bitsandbytes' multi-backend
    build is there (and no XPU), exactly when Accelerate refuses it (its test_accelerator patches these names)."""
    from unittest import mock

    accelerate = pytest.importorskip("accelerate")
    import nbaccel

    outcomes = []
    for library in (accelerate, nbaccel):
        library.state.AcceleratorState._reset_state(True)
        accelerator = library.Accelerator(cpu=True)
        model = torch.nn.Linear(2, 2)
        model.is_loaded_in_8bit, model.hf_device_map = True, {"": "cpu"}
        name = library.__name__
        with mock.patch(f"{name}.accelerator.is_bitsandbytes_multi_backend_available", return_value=multi_backend), \
                mock.patch(f"{name}.accelerator.is_xpu_available", return_value=xpu):
            try:
                accelerator.prepare_model(model)
                outcomes.append("prepared")
            except ValueError as error:
                outcomes.append("refused" if "CPU or disk offload" in str(error) else str(error))
        library.state.AcceleratorState._reset_state(True)
    assert outcomes[0] == outcomes[1] == ("prepared" if multi_backend and not xpu else "refused")
