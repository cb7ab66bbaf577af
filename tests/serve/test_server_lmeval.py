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


GREEDY_TASK_YAML = """\
task: attnlab_local_greedy
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
metadata:
  version: 1.0
"""


def attnlab_is_greedy(model, tokenizer, context: str, continuation: str) -> bool:
    """Whether every continuation token is the argmax of one full forward at its position."""
    whole = tokenizer.encode(context + continuation)
    n_context = len(tokenizer.encode(context))
    with torch.no_grad():
        best = model(torch.tensor([whole]))[0].argmax(-1)  # (T,)
    return all(int(best[i - 1]) == whole[i] for i in range(n_context, len(whole)))


def run_lm_eval(tmp_path, monkeypatch, engine_cls, docs, task, yaml):
    """lm-eval's `local-completions` on a local task through a server on the tiny checkpoint:
    (results, the server's model, its tokenizer)."""
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity", reason="lm-eval's API models need lm-eval[api] (tenacity)")
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / f"{task}.yaml").write_text(yaml.format(data=data))
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
            tasks=[task],
            task_manager=lm_eval.tasks.TaskManager(include_path=str(tasks)),
            log_samples=True,
            bootstrap_iters=0,
        )
    finally:
        server.close()
    return results, server.model, server.tokenizer


@pytest.mark.parametrize("engine_cls", engines(), ids=lambda c: c.__name__)
def test_lm_eval_scores_through_the_server(tmp_path, monkeypatch, engine_cls):
    results, model, tokenizer = run_lm_eval(
        tmp_path, monkeypatch, engine_cls, DOCS, "attnlab_local_mc", TASK_YAML
    )
    assert "acc,none" in results["results"]["attnlab_local_mc"]
    samples = results["samples"]["attnlab_local_mc"]
    assert len(samples) == len(DOCS)
    for sample in samples:
        for (context, continuation), response in zip(sample["arguments"], sample["resps"]):
            ll, _ = response[0]
            expected = attnlab_loglikelihood(model, tokenizer, context, continuation)
            assert ll == pytest.approx(expected, abs=1e-4), (context, continuation)


@pytest.mark.parametrize("engine_cls", engines(), ids=lambda c: c.__name__)
def test_lm_eval_loglikelihood_acc_through_the_server_is_the_direct_figure(
    tmp_path, monkeypatch, engine_cls
):
    """A loglikelihood task's acc is lm-eval's is_greedy, read from the echoed prompt's
    top_logprobs: through the server it equals the fraction greedy under a full forward."""
    ckpt = write_checkpoint(tmp_path / "direct")
    from attnlab.checkpoint import open_checkpoint

    loaded = open_checkpoint(ckpt)
    contexts = ["the cat sat on the", "the dog ate the", "hello", "hello world, hello"]
    docs = [{"question": c, "answer": a} for c in contexts for a in (" mat", " world")]
    for c in contexts:  # the token the model itself would write next: greedy by construction
        ids = loaded.tokenizer.encode(c)
        with torch.no_grad():
            best = int(loaded.model(torch.tensor([ids]))[0, -1].argmax())
        answer = loaded.tokenizer.decode([best])
        if loaded.tokenizer.encode(c + answer) == ids + [best]:  # a whole token, read back as is
            docs.append({"question": c, "answer": answer})
    results, model, tokenizer = run_lm_eval(
        tmp_path, monkeypatch, engine_cls, docs, "attnlab_local_greedy", GREEDY_TASK_YAML
    )
    samples = results["samples"]["attnlab_local_greedy"]
    direct = [attnlab_is_greedy(model, tokenizer, *s["arguments"][0]) for s in samples]
    assert 0 < sum(direct) < len(direct)  # both kinds, so a constant answer cannot pass
    got = results["results"]["attnlab_local_greedy"]["acc,none"]
    assert got == pytest.approx(sum(direct) / len(direct))
