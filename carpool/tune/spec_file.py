"""A mapping read from a YAML or JSON file a flag names (``--gpu FILE``, ``--model-config FILE``),
refused with the flag and the file named when it cannot be read."""

from __future__ import annotations

from pathlib import Path

import yaml

from carpool.errors import StartRefused


def read_mapping(path: Path, flag: str, error: type[StartRefused]) -> dict:
    """The file's top-level mapping (JSON is read as the YAML it also is)."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8-sig"))
    except OSError as e:
        raise error(f"{flag} {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise error(f"{flag} {path}: not YAML or JSON ({e})") from None
    if not isinstance(data, dict):
        raise error(f"{flag} {path}: a mapping of fields is needed")
    return data
