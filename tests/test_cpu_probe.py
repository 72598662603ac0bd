"""What the CPU does fast (infra/common/cpu.py): the bfloat16 probe and the flags it reads."""

from infra.common.cpu import bf16_gemm_is_native, cpu_flags

ICE_LAKE = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_vbmi2"}


def test_an_avx512_cpu_without_bf16_instructions_emulates_bfloat16():
    # oneDNN says "supported" on every AVX-512 CPU; the flags must overrule it.
    assert not bf16_gemm_is_native("x86_64", ICE_LAKE, onednn_says=True)
    assert not bf16_gemm_is_native("x86_64", {"avx2", "fma"}, onednn_says=True)


def test_avx512_bf16_or_amx_is_native_where_onednn_agrees():
    assert bf16_gemm_is_native("x86_64", ICE_LAKE | {"avx512_bf16"}, onednn_says=True)
    assert bf16_gemm_is_native("x86_64", ICE_LAKE | {"amx_bf16", "amx_tile"}, onednn_says=True)
    assert not bf16_gemm_is_native("x86_64", ICE_LAKE | {"avx512_bf16"}, onednn_says=False)


def test_unknown_flags_or_other_architectures_take_onednns_answer():
    assert bf16_gemm_is_native("x86_64", set(), onednn_says=True)  # /proc/cpuinfo unreadable
    assert bf16_gemm_is_native("aarch64", {"fp", "asimd"}, onednn_says=True)
    assert not bf16_gemm_is_native("aarch64", {"fp", "asimd", "bf16"}, onednn_says=False)


def test_cpu_flags_reads_the_first_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: x\nflags\t\t: fpu avx2 avx512f\n\nflags\t\t: other\n")
    assert cpu_flags(str(info)) == {"fpu", "avx2", "avx512f"}
    assert cpu_flags(str(tmp_path / "absent")) == set()
