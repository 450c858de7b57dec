"""Shared fixtures: the real corpus (the copy beside the checkout, or the packaged one), tiny
configs, a CUDA skip marker, a local HTTP server for the download tests."""

from __future__ import annotations

import collections
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from lora_bench.config import TrainConfig
from lora_bench.data.sms_spam import PACKAGED_CORPUS

# the corpus: LORA_BENCH_SMS_FILE where set, else the copy beside the checkout, else the one the
# package ships (the same file), so a machine with neither runs the tests that need it
_BESIDE = Path(__file__).resolve().parents[2] / "shared" / "data" / "SMSSpamCollection.tsv"
SHARED_DATA = Path(os.environ.get("LORA_BENCH_SMS_FILE") or (_BESIDE if _BESIDE.is_file() else PACKAGED_CORPUS))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def sms_file() -> Path:
    if not SHARED_DATA.is_file():
        pytest.skip(f"real corpus not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def hide_package(monkeypatch):
    """``hide_package(name)``: from then on lora-bench's optional imports of ``name`` (and of its
    submodules) fail as they do where the package is not installed."""
    import importlib

    real = importlib.import_module

    def hide(name: str) -> None:
        def import_module(module, *a, **kw):
            if module.split(".")[0] == name:
                raise ImportError(f"No module named {name!r}")
            return real(module, *a, **kw)

        monkeypatch.setattr("lora_bench.optional.importlib.import_module", import_module)

    return hide


@pytest.fixture
def tiny_cfg(sms_file) -> TrainConfig:
    """A tiny random-weight model on the real data, a handful of steps."""
    return TrainConfig(model_size="tiny", weights="random", trainable_layers="all", device="cpu",
                       data_file=str(sms_file), num_epochs=1, max_steps=6, eval_freq=3, eval_iter=2,
                       skip_final_eval=True, warmup_steps=2)


@pytest.fixture
def run_cli(monkeypatch, capsys):
    """Run ``lora-bench ARGS`` in-process through ``main()`` (the real error mapping);
    returns (exit code, stdout + stderr)."""
    from lora_bench import cli

    def run(*args: str) -> tuple[int, str]:
        monkeypatch.setattr("sys.argv", ["lora-bench", *map(str, args)])
        monkeypatch.setenv("COLUMNS", "200")
        code = 0
        try:
            cli.main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        captured = capsys.readouterr()
        return code, captured.out + captured.err

    return run


class _Handler(BaseHTTPRequestHandler):
    routes: dict = {}  # path -> (mode, bytes): "ok", or "truncate" (promises 1000 bytes more, then closes)
    hits: collections.Counter

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.hits[self.path] += 1
        mode, body = self.routes.get(self.path, ("missing", b""))
        if mode == "missing":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body) + (1000 if mode == "truncate" else 0)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # keep pytest output clean
        pass


@pytest.fixture
def http_server():
    """An HTTP server on 127.0.0.1 (ephemeral port): set ``routes``, read ``hits``; ``url`` is its base."""
    handler = type("Handler", (_Handler,), {"routes": {}, "hits": collections.Counter()})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, args=(0.01,), daemon=True).start()
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.routes, httpd.hits = handler.routes, handler.hits
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def refused_url(path: str = "/file.bin") -> str:
    """A URL on a port that refuses connections (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}{path}"


@pytest.fixture
def unwritable_dir(tmp_path) -> Path:
    """An existing folder that takes no new file: a read-only folder for an ordinary user; for
    root (whom file modes do not stop) a folder of the kernel's sysfs. Skips where neither holds."""
    from lora_bench.fileio import check_writable_dir

    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    folder = Path("/sys/kernel")
    if not folder.is_dir() or check_writable_dir(folder) is None:
        pytest.skip("no folder that refuses files to root on this machine")
    yield folder
