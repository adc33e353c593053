"""The KV cache the model allocates: zeroed (a masked-out key must be finite), writable, its own memory."""

import os

import pytest
import torch

from carpool.engine.loader import TINY_RANDOM_SHAPE, load_tiny_random
from carpool.engine.model import LlamaModel


def test_the_kv_cache_is_zeroed_writable_and_not_shared():
    loaded = load_tiny_random(0, dtype=torch.bfloat16)
    model = LlamaModel(loaded.config, loaded.state_dict, torch.bfloat16)
    caches = model.allocate_kv_cache(num_blocks=9, block_size=16)
    assert len(caches) == TINY_RANDOM_SHAPE["num_hidden_layers"]
    k0, v0 = caches[0]
    assert k0.shape == (9, 16, model.num_kv_heads, model.head_dim) and k0.dtype == torch.bfloat16
    assert k0.is_contiguous() and all(bool((t == 0).all()) for kv in caches for t in kv)
    k0[3].fill_(1.5)  # written in place, as the attention writes a block
    assert float(k0[3].sum()) == 1.5 * k0[3].numel() and float(k0[2].abs().sum()) == 0
    assert float(v0.abs().sum()) == 0 and float(caches[1][0].abs().sum()) == 0  # no two share memory


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_does_not_write_into_the_parents_kv_cache():
    loaded = load_tiny_random(0, dtype=torch.bfloat16)
    k = LlamaModel(loaded.config, loaded.state_dict, torch.bfloat16).allocate_kv_cache(2, 16)[0][0]
    pid = os.fork()
    if pid == 0:  # the child: write one element (no thread pool after fork) and leave at once
        k[0, 0, 0, 0] = 7.0
        os._exit(0)
    os.waitpid(pid, 0)
    assert float(k.abs().sum()) == 0
