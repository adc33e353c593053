"""``carpool cache stats|clear [--cache URL]``: inspect or empty the result cache."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["stats", "clear"], help="show the figures, or delete every entry")
    parser.add_argument(
        "--cache",
        metavar="URL",
        default=None,
        help="sqlite:///path/results.sqlite or redis://host:6379/0 "
        "(default: ${CARPOOL_CACHE_DIR:-~/.cache/carpool}/results.sqlite)",
    )
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

    try:
        store = open_cache(args.cache)
    except (ValueError, ConnectionError, OSError) as exc:
        print(f"carpool cache: {exc}", file=sys.stderr)
        return 2
    try:
        sem_dir = _semantic_dir(args, store)
        if args.action == "clear":
            before = store.stats().get("entries", 0)
            store.clear()
            report = {"cleared": {"exact": before}}
            if sem_dir is not None:
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
