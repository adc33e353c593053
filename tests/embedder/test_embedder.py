"""all-MiniLM-L6-v2 through plain transformers: shape, normalisation, semantics, batching."""

from __future__ import annotations

import numpy as np
import pytest

from carpool.embed.embedder import Embedder
from carpool.errors import EmbedderError

pytestmark = pytest.mark.real_model

TEXTS = [
    "A man is playing a guitar.",
    "Someone is playing an instrument.",
    "The stock market fell sharply today.",
    "Shares dropped steeply in early trading.",
    "hi",
    "A cat sleeps on the warm windowsill while rain taps against the glass. " * 12,  # truncated
]


def test_shape_dtype_unit_norm(embedder):
    assert embedder.dim == 384 and embedder.name == "all-MiniLM-L6-v2"
    out = embedder.embed(TEXTS)
    assert out.shape == (len(TEXTS), 384) and out.dtype == np.float32
    assert np.allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)
    assert embedder.embed([]).shape == (0, 384)


def test_cosine_is_semantic(embedder):
    e = embedder.embed(TEXTS[:4])
    sim = e @ e.T
    assert sim[0, 1] > 0.5 and sim[2, 3] > 0.5  # paraphrases
    assert sim[0, 2] < 0.2 and sim[1, 3] < 0.2  # unrelated
    assert sim[0, 1] > sim[0, 2] + 0.3


def test_batched_equals_one_by_one(embedder):
    batched = embedder.embed(TEXTS)
    single = np.stack([embedder.embed([t])[0] for t in TEXTS])
    assert np.abs(batched - single).max() < 1e-5
    # order is preserved although the embedder sorts by length internally
    shuffled = [TEXTS[i] for i in (5, 0, 4, 2)]
    assert np.abs(embedder.embed(shuffled) - batched[[5, 0, 4, 2]]).max() < 1e-5


def test_count_tokens(embedder):
    assert embedder.count_tokens("hello world") == 4  # [CLS] hello world [SEP]
    assert embedder.count_tokens("word " * 1000) == embedder.max_length
    assert embedder.count_tokens_batch(["hello world", "hi"]) == [4, 3]


def test_bad_input_and_unknown_model(embedder):
    with pytest.raises(EmbedderError, match="list of strings"):
        embedder.embed("not a list")
    with pytest.raises(EmbedderError, match="item 1"):
        embedder.embed(["ok", 3])
    with pytest.raises(EmbedderError, match="no-such-model"):
        Embedder("no-such-model")
