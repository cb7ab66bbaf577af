"""llama.cpp (through `llama-cpp-python`, an optional install: it compiles llama.cpp) runs
attnlab's F32 GGUF export of SmolLM2 and continues a prompt greedily as attnlab does.

Slow tier; skipped where llama_cpp or the SmolLM2 file is absent.
"""

import numpy as np
import pytest
import torch

from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from attnlab.interop.gguf import save_gguf
from tests.realmodel import open_smollm2

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.slow

PROMPT = "def fibonacci(n):\n    "
NEW_TOKENS = 32


def test_llama_cpp_continues_attnlabs_export_as_attnlab_does(tmp_path):
    loaded = open_smollm2()
    path = save_gguf(loaded.model, loaded.config, tmp_path / "smollm2-f32.gguf", loaded.tokenizer)
    llm = llama_cpp.Llama(str(path), n_ctx=256, n_threads=1, logits_all=True, verbose=False)
    ids = loaded.tokenizer.encode(PROMPT)
    assert llm.tokenize(PROMPT.encode(), add_bos=False, special=True) == ids
    theirs = []
    llm.eval(ids)
    for _ in range(NEW_TOKENS):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        theirs.append(token)
        llm.eval([token])
    with torch.no_grad():
        config = GenerationConfig(NEW_TOKENS, SamplingConfig(temperature=0.0))
        ours = generate(loaded.model, [ids], config)[0]
    assert ours == theirs
