"""What carpool may write or print of a job's configuration: the same rule everywhere.

A job's configuration carries secrets in three forms: a key (``--api-key``), the value of
an authenticating header (``Authorization``, ``X-Token``, ``X-Api-Key``, a cookie, ...)
and a password inside a URL (``http://user:pass@host``, ``redis://:pass@host``).  Every
place that records or shows the configuration -- the state file beside the output, the
"Resume with:" hint, ``--summary-json``, the ``--report`` page, warnings -- passes it
through this module, so that one rule decides what is masked and a new secret form is
added here once.

The rule masks too much rather than too little: a header is treated as a secret when its
name merely looks like one (``*token*``, ``*secret*``, ``*-key``, ``*auth*``, ...), because
showing a harmless value as ``***`` costs nothing while showing a key costs the key.

This module imports nothing of carpool, so every layer may use it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MASK = "***"

# Header names whose values authenticate: the exact names, then the name patterns.
_SECRET_NAMES = {"authorization", "proxy-authorization", "cookie", "set-cookie", "api-key", "x-api-key", "key"}
_SECRET_NAME_PARTS = re.compile(r"token|secret|passw|auth|cookie|session|credential|signature|[-_]key$|^key[-_]",
                                re.IGNORECASE)
# URL query parameters that carry a key (Azure's ``api-key``, signed URLs' ``sig``, ...).
_SECRET_QUERY = re.compile(r"([?&](?:api[-_]?key|key|token|access[-_]token|sig|signature|password|secret|"
                           r"code)=)[^&#\s'\"]*", re.IGNORECASE)
# scheme://userinfo@ in a URL anywhere in a text; the userinfo stops at the first '/', '@' or space.
_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^/@\s:'\"]*)(?::(?P<pw>[^/@\s'\"]*))?@")
# Credentials written out in free text: "Bearer KEY", "Basic B64", and OpenAI-style keys.
_SCHEME_TOKEN = re.compile(r"\b(Bearer|Basic)\s+[A-Za-z0-9._~+/=-]{4,}")
_KEY_LIKE = re.compile(r"\bsk-[A-Za-z0-9_-]{20,}")

# Flags whose whole value is a secret, and the variable a resumed run reads it from instead.
SECRET_FLAGS = {"--api-key": "CARPOOL_API_KEY"}
_HEADER_FLAG = "--header"


def is_secret_header(name: str) -> bool:
    """True when a header of this name authenticates (its value is never shown)."""
    n = name.strip().lower()
    return n in _SECRET_NAMES or bool(_SECRET_NAME_PARTS.search(n))


def _userinfo(m: re.Match) -> str:
    if m.group("pw") is not None:
        return f"{m.group('scheme')}{m.group('user')}:{MASK}@"
    return f"{m.group('scheme')}{MASK}@" if m.group("user") else m.group(0)


def redact_url(url: str) -> str:
    """``url`` (or a text holding URLs) with the password of each URL's user part (or, without
    one, the user part itself: ``https://TOKEN@host``) and key-like query parameters masked.
    Nothing else changes: an argument of a command line stays what it was unless it is a URL."""
    return _SECRET_QUERY.sub(lambda m: m.group(1) + MASK, _USERINFO.sub(_userinfo, url))


def redact_text(text: str) -> str:
    """A message: its URLs as ``redact_url`` shows them, and credentials written out
    (``Bearer KEY``, ``Basic B64``, an OpenAI-style ``sk-...`` key) masked."""
    text = _SCHEME_TOKEN.sub(lambda m: f"{m.group(1)} {MASK}", redact_url(text))
    return _KEY_LIKE.sub(f"sk-{MASK}", text)


def redact_header(line: str) -> str:
    """A ``'Name: value'`` header as it may be shown: the value masked when the name is a secret's."""
    name, sep, _ = line.partition(":")
    if sep and is_secret_header(name):
        return f"{name}: {MASK}"
    return redact_url(line)


def redact_headers(headers: dict[str, str]) -> dict[str, str]:
    return {k: MASK if is_secret_header(k) else redact_text(v) for k, v in headers.items()}


def _flag(arg: str, full: str) -> tuple[bool, str | None]:
    """Whether ``arg`` is the flag ``full`` (or an abbreviation argparse accepts, at least up
    to the first letter after ``--``'s first word) and its ``=value`` when written joined."""
    name, eq, value = arg.partition("=")
    shortest = full[: full.index("-", 2) + 2] if "-" in full[2:] else full[:4]
    if name.startswith("--") and len(name) >= len(shortest) and full.startswith(name):
        return True, value if eq else None
    return False, None


def redact_argv(argv: Iterable[str], *, drop_secret_flags: bool = False) -> list[str]:
    """A command line as it may be recorded: ``--api-key`` values masked (or the flag dropped
    altogether, for a command to run again), secret header values masked, and every URL's
    password masked."""
    out: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        secret = next((f for f in SECRET_FLAGS if _flag(arg, f)[0]), None)
        if secret is not None:
            joined = _flag(arg, secret)[1] is not None
            i += 1 if joined else 2
            if not drop_secret_flags:
                out += [f"{secret}={MASK}"]
            continue
        is_header, value = _flag(arg, _HEADER_FLAG)
        if is_header and value is not None:
            out.append(f"{_HEADER_FLAG}={redact_header(value)}")
        elif is_header and i + 1 < len(args):
            out += [arg, redact_header(args[i + 1])]
            i += 1
        else:
            out.append(redact_url(arg))
        i += 1
    return out


def secret_flags_in(argv: Iterable[str]) -> list[str]:
    """The secret-valued flags (``--api-key``) a command line holds, by their full names."""
    found = []
    for arg in argv:
        for f in SECRET_FLAGS:
            if _flag(arg, f)[0] and f not in found:
                found.append(f)
    return found


def redact_doc(doc: object) -> object:
    """A JSON-like document (a summary, a report's table) with every string in it redacted."""
    if isinstance(doc, str):
        return redact_text(doc)
    if isinstance(doc, dict):
        return {k: redact_doc(v) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [redact_doc(v) for v in doc]
    return doc


def resume_command(argv: Iterable[str]) -> str:
    """The command that resumes a job started with ``argv`` (``carpool`` and its arguments,
    ``--fresh`` left out), safe to print: the secrets are not in it, and a line under it says
    how to give them again (the key through its variable, masked values by hand)."""
    import shlex

    argv = [a for a in argv if a != "--fresh"]
    shown = redact_argv(argv, drop_secret_flags=True)
    notes = [f"{f} is not shown: export {SECRET_FLAGS[f]}=<the key> first" for f in secret_flags_in(argv)]
    if any(MASK in a for a in shown) and not any(MASK in a for a in argv):
        notes.append(f"put back the secrets shown as {MASK}")
    line = "carpool " + shlex.join(shown)
    return line + (f"\n  ({'; '.join(notes)})" if notes else "")
