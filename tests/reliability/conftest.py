"""The training fixtures (one CPU thread, a tiny corpus, make_run) for the fault-injection tests."""

from tests.training.conftest import make_run, one_thread, tiny_text  # noqa: F401 (fixtures)
