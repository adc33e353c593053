"""Which model a name asks for, and what to say when it asks for none.

A user coming from vLLM writes a model's Hugging Face name: the shipped SmolLM2 answers to
``HuggingFaceTB/SmolLM2-135M-Instruct`` as well as to ``smollm2``, and any other ``org/name``
is looked up in the local Hugging Face cache (a model downloaded earlier, by any tool).
Nothing is downloaded here.  A name that is none of these is refused with the closest
names carpool knows, so a typo is one edit away from a run.

No torch here: ``carpool run --estimate`` resolves names with only the tokenizer.
"""

from __future__ import annotations

import difflib
from pathlib import Path

SMOLLM2_HF_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Every spelling of the shipped generation model, lower case.
SMOLLM2_NAMES = frozenset({"smollm2", "smollm2-135m", "smollm2-135m-instruct", SMOLLM2_HF_NAME.lower()})
# What the suggestions are drawn from: the names a user would type.
KNOWN = ("smollm2", "tiny-random", SMOLLM2_HF_NAME)


def is_smollm2(name: str) -> bool:
    return name.strip().lower() in SMOLLM2_NAMES


def canonical(name: str) -> str:
    """The one name a model goes by in the result cache's keys and a run's fingerprint,
    whichever way it was asked for, so that the same weights asked for under two names share
    their cached answers and a resume: the shipped SmolLM2 under any of its spellings is
    ``smollm2``, ``tiny-random:0`` is ``tiny-random``, a folder or ``.gguf`` file is its absolute
    path (``./m`` from two directories is two models).  Any other name is kept as given."""
    name = name.strip()
    if is_smollm2(name):
        return "smollm2"
    base, _, seed = name.partition(":")
    if base == "tiny-random" and seed.isdigit():
        return base if int(seed) == 0 else f"{base}:{int(seed)}"
    path = Path(name).expanduser()
    if name and path.exists():
        return str(path.resolve())
    return name


def closest(name: str, candidates: tuple[str, ...] = KNOWN) -> list[str]:
    """Known names that look like ``name`` (a typo, another case), best first."""
    by_lower = {c.lower(): c for c in candidates}
    return [by_lower[m] for m in difflib.get_close_matches(name.strip().lower(), list(by_lower), n=2, cutoff=0.6)]


def hf_cache_folder(name: str) -> Path | None:
    """The cached snapshot of a Hugging Face repo id (``org/name``), if one is on this machine."""
    if name.count("/") != 1 or name.startswith(("/", ".", "~")):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # only the engine extra brings it
        return None
    try:
        found = try_to_load_from_cache(name, "config.json")
    except ValueError:  # not the shape of a repo id
        return None
    return Path(found).parent if isinstance(found, str) else None


def unknown_model(name: str) -> str:
    """Why ``name`` loads nothing, and the closest names that would."""
    near = closest(name)
    hint = f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
    if name.count("/") == 1 and not Path(name).expanduser().exists():
        hint += (f" ({name!r} is not in the local Hugging Face cache: download it first, e.g. "
                 f"`huggingface-cli download {name}`, or pass its folder)")
    return (f"model={name!r}: not 'smollm2' (the shipped SmolLM2-135M-Instruct, also called {SMOLLM2_HF_NAME}), "
            "'tiny-random[:SEED]', a Hugging Face folder or a model in the local Hugging Face cache, or a "
            f".gguf file; carpool downloads nothing{hint}")
