"""engine/cpu.py reads the CPU from /proc/cpuinfo: the flags sorted (the build key and the plan's
fingerprint hash them, so their order must not matter), the first processor's model name, and
the platform's names where there is no /proc/cpuinfo."""

from __future__ import annotations

import platform

import pytest

from carpool.engine import cpu

XEON = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu avx512f amx_tile avx512_bf16 amx_bf16 avx512_vnni amx_int8

processor\t: 1
model name\t: another name a hybrid CPU might give its second core
flags\t\t: fpu
"""


@pytest.fixture
def cpuinfo(tmp_path, monkeypatch):
    def use(text: str | None):
        path = tmp_path / "cpuinfo"
        if text is not None:
            path.write_text(text)
        monkeypatch.setattr(cpu, "CPUINFO", path)
        cpu.flags.cache_clear()

    yield use
    cpu.flags.cache_clear()


def test_an_amx_xeon_is_read_from_its_first_processor(cpuinfo):
    cpuinfo(XEON)
    assert cpu.flag_text() == "amx_bf16 amx_int8 amx_tile avx512_bf16 avx512_vnni avx512f fpu"
    assert cpu.model_name() == "Intel(R) Xeon(R) Platinum 8480+"
    assert cpu.has("amx_bf16") and cpu.native_bf16() and not cpu.has("sve")
    d = cpu.describe()
    assert (d["family"], d["model_number"]) == ("6", "143")
    assert all(d[f] for f in cpu.ROUTE_FLAGS) and isinstance(d["cores"], int)


def test_a_cpu_without_bf16_computes_bf16_through_fp32(cpuinfo):
    cpuinfo("processor\t: 0\nmodel name\t: AMD EPYC 7B12\nflags\t\t: fpu avx2 avx512f\n")
    assert not cpu.native_bf16() and not cpu.describe()["avx512_bf16"]


def test_without_proc_cpuinfo_the_platform_names_the_cpu(cpuinfo):
    cpuinfo(None)
    assert cpu.flag_text() == f"{platform.machine()}|{platform.processor()}"
    assert cpu.model_name() == (platform.processor() or platform.machine())
    assert not cpu.native_bf16()
