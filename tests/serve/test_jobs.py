"""`run_job` of both engines (types.py's Jobs): the job runs on the engine's thread (inline on
an engine never started), its value or exception goes to the future, the engine serves on
after a failing job, stop() fails the jobs still waiting, and a job sees the base model even
inside a request's LoRA block."""

import threading

import pytest
import torch

from attnlab.adapters.multi_lora import MultiLoRALinear, adapter_rows
from attnlab.models.build import build_model
from attnlab.models.presets import get_preset
from attnlab.serve.engine import Engine
from attnlab.serve.sequential import SequentialEngine
from attnlab.serve.types import EngineConfig, EngineStopped, Jobs, Request, SamplingParams

ENGINES = [SequentialEngine, Engine]


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(1)
    return build_model(get_preset("gpt2-tiny")).eval()


def make(cls, model):
    return cls(model, None, EngineConfig(max_batch=2, max_context=64))


@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.__name__)
def test_an_engine_never_started_runs_the_job_inline(cls, gpt2):
    engine = make(cls, gpt2)
    future = engine.run_job(threading.current_thread)
    assert future.done() and future.result() is threading.current_thread()
    failed = engine.run_job(lambda: 1 / 0)
    assert isinstance(failed.exception(), ZeroDivisionError)


@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.__name__)
def test_a_job_runs_on_the_engine_thread_and_a_failing_one_harms_nothing(cls, gpt2):
    engine = make(cls, gpt2)
    engine.start()
    try:
        assert engine.run_job(lambda: threading.current_thread().name).result(10) == (
            "attnlab-engine"
        )
        with pytest.raises(ZeroDivisionError):
            engine.run_job(lambda: 1 / 0).result(10)
        done, events = threading.Event(), []

        def on_event(event):
            events.append(event)
            if event.finish_reason:
                done.set()

        engine.submit(Request("after", (1, 2, 3), SamplingParams(4, 0.0)), on_event)
        assert done.wait(10) and events[-1].finish_reason == "length"
    finally:
        engine.stop(5)


@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.__name__)
def test_stop_fails_the_waiting_jobs_and_refuses_new_ones(cls, gpt2):
    engine = make(cls, gpt2)
    engine.start()
    running, release = threading.Event(), threading.Event()

    def blocking():
        running.set()
        release.wait(10)
        return "ran"

    first = engine.run_job(blocking)
    assert running.wait(10)  # the engine's thread is inside the first job
    second = engine.run_job(lambda: "never")
    stopper = threading.Thread(target=engine.stop, args=(5,))
    stopper.start()
    assert isinstance(second.exception(10), EngineStopped)
    release.set()
    stopper.join(10)
    assert first.result(10) == "ran"  # a job already running runs to its end
    with pytest.raises(EngineStopped):
        engine.run_job(lambda: "late")


def test_a_job_sees_the_base_inside_a_requests_adapter_block():
    """The sequential engine runs jobs between the tokens of a request, inside the request's
    adapter block: the job sees no adapter rows, and the request's rows are back after it."""
    base = torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(MultiLoRALinear(base, [(torch.ones(2, 4), torch.ones(4, 2), 1.0)]))
    jobs = Jobs(threading.Condition(), model)
    seen = []
    future = jobs.add(lambda: seen.append(model[0].rows))
    rows = torch.tensor([1])
    with adapter_rows(model, rows):
        jobs.run()
        assert model[0].rows is rows
    assert future.done() and seen == [None]
    assert model[0].rows is None
