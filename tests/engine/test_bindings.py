"""The kernels' ops are declared once (``Kernels`` methods with their C++ declarations): the compiled
module binds exactly those, and the Python calls pass the instruction set level where the
declaration takes one."""

from __future__ import annotations

import pytest
import torch

from carpool.engine.ops import Kernels, bindings, build


def test_a_declaration_gives_the_parameters_their_defaults_and_the_isa():
    op = bindings.parse("f", "std::tuple<at::Tensor, at::Tensor> f(c10::optional<at::Tensor> bias, bool split = false, "
                             "int64_t isa)", "First line.\n\nMore.")
    assert op.returns == "std::tuple<at::Tensor, at::Tensor>"
    assert op.params == (("c10::optional<at::Tensor>", "bias", None), ("bool", "split", "false"),
                         ("int64_t", "isa", None))
    assert op.takes_isa and op.doc == "First line."
    assert not bindings.parse("g", "void g()", "").params
    with pytest.raises(ValueError, match="not a C\\+\\+ declaration of h"):
        bindings.parse("h", "void g()", "")


def test_the_binding_source_binds_every_declared_op_once():
    src = bindings.source(build.BINDING_HEADERS)
    for name in bindings.OPS:
        assert src.count(f'm.def("{name}", &carpool::{name},') == 1
    assert 'py::arg("split_rows") = false' in src
    assert {"attention", "silu_mul", "bf16_gemm", "brgemm_attention_runs"} <= set(bindings.OPS)


def test_the_compiled_module_has_exactly_the_declared_ops(best_isa):
    k = Kernels(isa=min(1, best_isa))
    if not k.wait():
        pytest.skip(f"kernels unavailable: {k.error}")
    bound = {n for n in dir(k.module) if not n.startswith("__")}
    assert bound == set(bindings.OPS)
    # An ISA op gets the Kernels' level: the AVX2 copy (or scalar) here, and the same values as the best copy.
    gu = torch.randn(3, 64)
    best = Kernels()
    assert best.wait()
    torch.testing.assert_close(k.silu_mul(gu), best.silu_mul(gu), rtol=1e-6, atol=1e-6)
    assert k.best_isa() == best_isa and k.row_grains() == best.row_grains()
