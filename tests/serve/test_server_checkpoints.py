"""Any decoder checkpoint `open_checkpoint` reads is served: a quantized one and one converted to
the HF format answer as attnlab's own `generate` does on the same loaded model."""

import openai
import pytest

from attnlab.cli.__main__ import main
from attnlab.inference.config import GenerationConfig
from attnlab.inference.generate import generate
from attnlab.inference.sampling import SamplingConfig
from attnlab.quantize import Int8Linear
from tests.serve.server_helpers import Server, write_checkpoint


@pytest.mark.slow  # among the slowest of the fast tier (kept under 2 minutes)
@pytest.mark.parametrize(
    "make",
    [
        lambda src, out: ["quantize", "--ckpt", str(src), "--scheme", "int8", "--out", str(out)],
        lambda src, out: ["convert", "--from", "attnlab", str(src), "--to", "hf", str(out)],
    ],
    ids=["int8", "hf"],
)
def test_converted_checkpoints_are_served(tmp_path, make):
    src = write_checkpoint(tmp_path / "tiny")
    assert main(make(src, tmp_path / "out")) == 0
    s = Server(tmp_path / "out")
    try:
        if "int8" in str(make(src, "")):
            assert any(isinstance(m, Int8Linear) for m in s.model.modules())
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="-", max_retries=0)
        r = client.completions.create(model="tiny", prompt="hello cat", max_tokens=8, temperature=0)
        ids = s.tokenizer.encode("hello cat")
        eos = [s.tokenizer.token_id("<eos>")]
        expected = generate(
            s.model, [ids], GenerationConfig(8, SamplingConfig(temperature=0), stop_tokens=eos)
        )[0]
        assert r.choices[0].text == s.tokenizer.decode(expected)
    finally:
        s.close()
