"""The kernels' op list: each op declared once, and both its Python call and its C++ binding made
from that declaration.

An op is a typed method of ``build.Kernels`` decorated with ``op("<its C++ declaration>")``:
the method's signature and docstring are the Python side (what callers and mypy see), the C++
declaration names the function a ``.cpp`` file defines.  ``op`` records both and replaces the
method's body by the call into the compiled module; ``source()`` writes the extension's binding
source from the same records (a declaration and an ``m.def`` per op, with the parameter names
and defaults of the C++ declaration), which the build compiles with the kernels.  An op whose
C++ declaration ends in ``int64_t isa`` is passed the instruction set level of its ``Kernels``
(callers pass the other arguments by position then).  Adding an op: define it in a ``.cpp``,
declare it once in ``Kernels``.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Op:
    name: str
    returns: str
    params: tuple[tuple[str, str, str | None], ...]  # (C++ type, name, default or None)
    doc: str

    @property
    def takes_isa(self) -> bool:
        return bool(self.params) and self.params[-1][1] == "isa"


OPS: dict[str, Op] = {}  # in declaration order


def _split_params(text: str) -> list[str]:
    """Top-level comma-separated parts (commas inside <> or () belong to their part)."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [p.strip() for p in [*parts, cur] if p.strip()]


def parse(name: str, cpp: str, doc: str) -> Op:
    """The op ``name`` from its C++ declaration ``<returns> name(<type> <param> [= default], ...)``."""
    m = re.fullmatch(rf"\s*(.+?)\s+{re.escape(name)}\s*\((.*)\)\s*", cpp, re.S)
    if m is None:
        raise ValueError(f"op {name}: {cpp!r} is not a C++ declaration of {name}(...)")
    params = []
    for part in _split_params(m.group(2)):
        decl, _, default = part.partition("=")
        pm = re.fullmatch(r"(.+?)\s*\b([A-Za-z_]\w*)", decl.strip(), re.S)
        if pm is None:
            raise ValueError(f"op {name}: parameter {part!r} has no name")
        params.append((pm.group(1), pm.group(2), default.strip() or None))
    first = doc.strip().split("\n\n")[0]
    return Op(name, m.group(1), tuple(params), " ".join(first.split()))


def op(cpp: str) -> Callable[[F], F]:
    """Declare the decorated ``Kernels`` method as the op of C++ declaration ``cpp``."""

    def declare(stub: F) -> F:
        spec = parse(stub.__name__, cpp, inspect.getdoc(stub) or stub.__name__)
        OPS[spec.name] = spec
        name, isa = spec.name, spec.takes_isa

        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            fn = getattr(self.module, name)
            return fn(*args, self.isa, **kwargs) if isa else fn(*args, **kwargs)

        return cast(F, functools.wraps(stub)(call))

    return declare


def _c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def source(headers: tuple[str, ...]) -> str:
    """The extension's binding source for every declared op (``headers``: included first, so an
    op defined inline there is bound as it is)."""
    lines = ["// Generated at build time from the op declarations of carpool/engine/ops/build.py (bindings.py).",
             "#include <torch/extension.h>", *(f'#include "{h}"' for h in headers), "", "namespace carpool {"]
    for o in OPS.values():
        lines.append(f"{o.returns} {o.name}({', '.join(f'{t} {n}' for t, n, _ in o.params)});")
    lines += ["}  // namespace carpool", "",
              # The ops run without the GIL, as torch's own ops do: a server's event loop shares the
              # process with the engine's thread, and while a kernel held the GIL an arriving request
              # could not even be read.  Arguments are converted before the release; nothing in an op
              # touches a Python object.
              "namespace {", "const pybind11::call_guard<pybind11::gil_scoped_release> kNoGil;", "}  // namespace", "",
              "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {"]
    for o in OPS.values():
        args = "".join(f', py::arg("{n}")' + (f" = {d}" if d is not None else "") for _, n, d in o.params)
        lines.append(f'  m.def("{o.name}", &carpool::{o.name}, kNoGil, {_c_string(o.doc)}{args});')
    lines.append("}")
    return "\n".join(lines) + "\n"
