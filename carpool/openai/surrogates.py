"""Text that is not Unicode: a lone UTF-16 surrogate, which only a JSON escape can produce.

``"\\ud800"`` without its pair decodes to a Python string that has no UTF-8 form: the
tokenizer refuses it, a journal cannot hash it and a response cannot carry it.  Every door
that takes JSON (a request body, a batch line) finds it here and answers a 400 naming the
field, instead of failing somewhere inside.
"""

from __future__ import annotations

import re

from carpool.errors import OpenAIError

# Only a JSON escape can put a surrogate in a string (the UTF-8 decoder refuses encoded
# ones), so the body is walked only when one of these is in the raw bytes.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def lone_surrogate_path(obj: object, path: str = "") -> str | None:
    """The path (``messages[0].content``) of the first string or key holding a lone surrogate."""
    if isinstance(obj, str):
        return path or "body" if _has_lone_surrogate(obj) else None
    if isinstance(obj, dict):
        for k, v in obj.items():
            name = str(k).encode("utf-8", "backslashreplace").decode("utf-8")  # the path itself must be text
            here = f"{path}.{name}" if path else name
            if _has_lone_surrogate(k):
                return here
            found = lone_surrogate_path(v, here)
            if found is not None:
                return found
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found = lone_surrogate_path(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def surrogate_error(where: str) -> OpenAIError:
    """The 400 for a lone surrogate at ``where`` (a field path)."""
    return OpenAIError(400, f"'{where}' holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair): "
                       "not Unicode text; send the character itself or a valid pair", param=where, code="invalid_json")
