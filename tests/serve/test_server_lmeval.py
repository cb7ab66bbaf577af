"""lm-eval's `local-completions` model scores a small local multiple-choice task through the
server, and its log-likelihoods equal attnlab's own scoring (log-softmax of the model over the
continuation) within 1e-4. Nothing is downloaded: the task is a JSONL file the test writes, read
by the `datasets` library's local json builder, with the hub offline."""

import json
import os

import pytest
import torch

from tests.serve.server_helpers import Server, engines, write_checkpoint

os.environ["HF_DATASETS_OFFLINE"] = "1"  # before `datasets` is imported (it reads them then)
os.environ["HF_HUB_OFFLINE"] = "1"

pytestmark = pytest.mark.slow

DOCS = [
    {"question": "the cat sat on the", "choices": ["mat", "dog", "bone"], "label": 0},
    {"question": "the dog ate the", "choices": ["bone", "world", "cat"], "label": 0},
    {"question": "hello", "choices": ["world", "mat"], "label": 0},
    {"question": "hello world, hello", "choices": ["cat", "dog", "sat on"], "label": 0},
]

TASK_YAML = """\
task: attnlab_local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
metadata:
  version: 1.0
"""


def attnlab_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """sum over the continuation's tokens of log p(token | everything before it)."""
    whole = tokenizer.encode(context + continuation)
    n_context = len(tokenizer.encode(context))
    with torch.no_grad():
        logits = model(torch.tensor([whole]))[0].float()  # (T, V)
    logp = torch.log_softmax(logits, dim=-1)
    return sum(logp[i - 1, whole[i]].item() for i in range(n_context, len(whole)))


@pytest.mark.parametrize("engine_cls", engines(), ids=lambda c: c.__name__)
def test_lm_eval_scores_through_the_server(tmp_path, monkeypatch, engine_cls):
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity", reason="lm-eval's API models need lm-eval[api] (tenacity)")
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "attnlab_local_mc.yaml").write_text(TASK_YAML.format(data=data))
    server = Server(write_checkpoint(tmp_path / "tiny"), engine_cls)
    try:
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={
                "base_url": f"{server.url}/v1/completions",
                "model": "tiny",
                "tokenizer_backend": "remote",  # the server's /tokenize (no HF tokenizer)
                "max_length": server.config.max_seq_len,
                "num_concurrent": 1,
                "max_retries": 1,
            },
            tasks=["attnlab_local_mc"],
            task_manager=lm_eval.tasks.TaskManager(include_path=str(tasks)),
            log_samples=True,
            bootstrap_iters=0,
        )
    finally:
        server.close()
    assert "acc,none" in results["results"]["attnlab_local_mc"]
    samples = results["samples"]["attnlab_local_mc"]
    assert len(samples) == len(DOCS)
    for sample in samples:
        for (context, continuation), response in zip(sample["arguments"], sample["resps"]):
            ll, _ = response[0]
            expected = attnlab_loglikelihood(server.model, server.tokenizer, context, continuation)
            assert ll == pytest.approx(expected, abs=1e-4), (context, continuation)
