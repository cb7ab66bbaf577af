"""Named datasets: downloaded once, SHA-256 checked, clear when offline. Nothing here touches the
network: downloads come from a file:// URL or a server on 127.0.0.1 serving the test fixture."""

import hashlib
import http.server
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from attnlab.training import datasets
from attnlab.training.config import DataConfig
from attnlab.training.data import corpus_files, prepare_text_data
from tests.data import SHAKESPEARE

FIXTURE_SHA = hashlib.sha256(SHAKESPEARE.read_bytes()).hexdigest()
CANONICAL = datasets.DATASETS["shakespeare"]  # read before any test patches the registry


@pytest.fixture(autouse=True)
def data_home(tmp_path, monkeypatch) -> Path:
    """An empty data home, and a registry whose 'shakespeare' is the fixture at a dead URL (a
    test that forgot to give a URL fails instead of downloading)."""
    home = tmp_path / "data_home"
    monkeypatch.setenv("ATTNLAB_DATA", str(home))
    real = datasets.DATASETS["shakespeare"]
    fake = replace(
        real, url="http://127.0.0.1:9/none", sha256=FIXTURE_SHA, size=SHAKESPEARE.stat().st_size
    )
    monkeypatch.setitem(datasets.DATASETS, "shakespeare", fake)
    return home


@pytest.fixture
def server():
    """A local HTTP server: serve(bytes) -> URL; `.hits` counts the requests."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            Handler.hits += 1
            self.send_response(200)
            self.send_header("Content-Length", str(len(Handler.body)))
            self.end_headers()
            self.wfile.write(Handler.body)

        def log_message(self, *args):
            pass

    Handler.hits, Handler.body = 0, b""
    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()

    def serve(body: bytes) -> str:
        Handler.body = body
        return f"http://127.0.0.1:{httpd.server_port}/input.txt"

    serve.handler = Handler
    yield serve
    httpd.shutdown()
    httpd.server_close()


def test_the_registry_holds_the_canonical_file():
    assert CANONICAL.url == (
        "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
    )
    assert CANONICAL.size == 1_115_394
    assert CANONICAL.sha256 == "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
    # the fixture is the start of that file
    assert SHAKESPEARE.read_text().startswith("First Citizen:\nBefore we proceed any further")


def test_a_download_is_checked_cached_and_done_once(server, data_home):
    url = server(SHAKESPEARE.read_bytes())
    path = datasets.fetch("shakespeare", url=url)
    assert path == data_home / "tinyshakespeare.txt"
    assert path.read_bytes() == SHAKESPEARE.read_bytes()
    assert datasets.fetch("shakespeare", url=url) == path  # cached: no second request
    assert server.handler.hits == 1
    assert sorted(p.name for p in data_home.iterdir()) == ["tinyshakespeare.txt"]


def test_a_file_url_works_too(data_home):
    path = datasets.fetch("shakespeare", url=SHAKESPEARE.as_uri())
    assert datasets.sha256_of(path) == FIXTURE_SHA


def test_a_corrupt_download_is_deleted_and_reported(server, data_home):
    body = SHAKESPEARE.read_bytes()[:-100]  # truncated
    with pytest.raises(ValueError, match=r"is not the expected tinyshakespeare\.txt.*deleted"):
        datasets.fetch("shakespeare", url=server(body))
    assert not data_home.exists() or list(data_home.iterdir()) == []  # no partial file left


def test_a_wrong_cached_file_is_fetched_again(server, data_home):
    data_home.mkdir()
    (data_home / "tinyshakespeare.txt").write_text("not it")
    path = datasets.fetch("shakespeare", url=server(SHAKESPEARE.read_bytes()))
    assert datasets.sha256_of(path) == FIXTURE_SHA and server.handler.hits == 1


def test_no_network_says_what_to_do(data_home):
    with pytest.raises(datasets.DatasetUnavailable) as e:
        datasets.fetch("shakespeare", url="http://127.0.0.1:9/input.txt", timeout=5)
    message = str(e.value)
    assert "attnlab data get shakespeare --from PATH" in message
    assert "--data.source PATH" in message and "\n" not in message
    assert not data_home.exists() or list(data_home.iterdir()) == []


def test_a_local_copy_is_registered_after_its_hash_is_checked(tmp_path, data_home):
    path = datasets.register("shakespeare", SHAKESPEARE)
    assert path.read_bytes() == SHAKESPEARE.read_bytes() and datasets.is_cached("shakespeare")
    wrong = tmp_path / "other.txt"
    wrong.write_text("To be or not to be")
    (data_home / "tinyshakespeare.txt").unlink()
    with pytest.raises(ValueError, match=rf"{wrong} is not the expected .*not copied"):
        datasets.register("shakespeare", wrong)
    assert list(data_home.iterdir()) == []


def test_a_recipe_names_the_dataset_and_gets_the_cached_file(tmp_path, data_home):
    datasets.register("shakespeare", SHAKESPEARE)
    assert corpus_files("shakespeare") == [data_home / "tinyshakespeare.txt"]
    cfg = DataConfig(source="shakespeare", max_chars=20_000, cache_dir=str(tmp_path / "cache"))
    data = prepare_text_data(cfg)
    assert data.tokenizer.decode(data.train[:6].tolist()) == "First "


def test_a_missing_dataset_without_network_is_one_clear_error(data_home):
    with pytest.raises(ValueError, match=r"attnlab data get shakespeare"):
        corpus_files("shakespeare")  # the registry's URL is a dead local port
