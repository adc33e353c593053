"""``carpool cache stats|clear [--cache URL] [--model NAME] [--namespace NAME]``: inspect
or empty the result cache, all of it or one model's / one namespace's entries."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _clear(store, model: str | None, namespace: str | None) -> int:
    """Entries removed: a model asked for under another of its names (the shipped SmolLM2 by its
    Hugging Face name) is the one its answers were stored under, so both are cleared."""
    from carpool.engine.model_names import canonical

    names = {model} if model is None else {model, canonical(model)}
    return sum(store.clear(model=name, namespace=namespace) for name in names)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["stats", "clear"], help="show the figures, or delete every entry")
    parser.add_argument(
        "--cache",
        metavar="URL",
        default=None,
        help="sqlite:///path/results.sqlite or redis://host:6379/0 "
        "(default: ${CARPOOL_CACHE_DIR:-~/.cache/carpool}/results.sqlite)",
    )
    parser.add_argument("--model", metavar="NAME", default=None,
                        help="clear: only the entries of this model (the name the tasks sent, e.g. gpt-4o-mini)")
    parser.add_argument("--namespace", metavar="NAME", default=None,
                        help="clear: only the entries stored with --cache-namespace NAME (with --model: both)")
    parser.add_argument(
        "--semantic-dir",
        metavar="DIR",
        default=None,
        help="semantic cache directory (default: 'semantic' beside the SQLite file; "
        "with Redis only when given); included when it exists",
    )


def _semantic_dir(args: argparse.Namespace, store) -> Path | None:
    from carpool.cache import default_semantic_dir

    if args.semantic_dir:
        path = Path(args.semantic_dir)
    elif getattr(store, "path", None) is not None:  # SQLite: the semantic cache lives beside it
        path = default_semantic_dir(store)
    else:  # Redis / off: only when named, so clearing Redis never empties a local folder
        return None
    return path if (path / "semantic.sqlite").exists() else None


def main(args: argparse.Namespace) -> int:
    from carpool.cache import open_cache

    if args.action != "clear" and (args.model is not None or args.namespace is not None):
        print("carpool cache: --model and --namespace select what `carpool cache clear` deletes; "
              "`stats` shows every model (its by_model list)", file=sys.stderr)
        return 2
    try:
        store = open_cache(args.cache, create=False)
    except FileNotFoundError as exc:  # nothing cached there yet: said, and nothing made
        where = {"backend": "sqlite", "location": exc.filename, "exists": False, "entries": 0}
        doc = {"cleared": {"exact": 0}} if args.action == "clear" else {"exact": where}
        print(json.dumps(doc, indent=2))
        print(f"carpool cache: no cache file at {exc.filename}", file=sys.stderr)
        return 0
    except (ValueError, ConnectionError, OSError) as exc:
        print(f"carpool cache: {exc}", file=sys.stderr)
        return 2
    try:
        sem_dir = _semantic_dir(args, store)
        if args.action == "clear":
            selected = args.model is not None or args.namespace is not None
            report: dict = {"cleared": {"exact": _clear(store, args.model, args.namespace)}}
            if selected:
                report["selected"] = {k: v for k, v in (("model", args.model), ("namespace", args.namespace))
                                      if v is not None}
                if sem_dir is not None:  # its entries are filed by scope hash, not by model
                    report["semantic"] = ("not cleared: its entries cannot be selected by model or namespace; "
                                          "`carpool cache clear` without them empties it")
            elif sem_dir is not None:
                from carpool.cache.semantic import SemanticCache

                # An embedder is never needed to count or delete entries.
                with SemanticCache(sem_dir, embedder=lambda texts: None) as sem:
                    report["cleared"]["semantic"] = len(sem)
                    sem.clear()
            print(json.dumps(report, indent=2))
            return 0
        stats = store.stats()
        # A stats call is not a lookup: show what the store holds and its lifetime counts.
        for name in ("hits", "misses", "expired", "puts", "evicted", "hit_rate"):
            stats.pop(name, None)
        report = {"exact": stats}
        if sem_dir is not None:
            from carpool.cache.semantic import SemanticCache

            with SemanticCache(sem_dir, embedder=lambda texts: None) as sem:
                sem_stats = sem.stats()
            report["semantic"] = {
                k: sem_stats[k] for k in ("location", "entries", "scopes")
            }
        print(json.dumps(report, indent=2))
        return 0
    finally:
        store.close()
