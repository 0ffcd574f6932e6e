"""Building, caching and loading the native kernel library, and the fallbacks around it."""

from __future__ import annotations

import shutil

import pytest
import torch

from common.native import library

needs_compiler = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler"
)


@needs_compiler
def test_build_is_cached_per_source_and_loads(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = library.build("latent_attention")
    assert first.parent == tmp_path / "tpla-serve" / "native" and first.exists()
    mtime = first.stat().st_mtime_ns
    assert library.build("latent_attention") == first  # cached: not rebuilt
    assert first.stat().st_mtime_ns == mtime
    assert library.load("latent_attention").tpla_paged_attention is not None
    assert not list(first.parent.glob("*.so.*")) and len(list(first.parent.glob("tmp*"))) == 0


@needs_compiler
def test_without_a_compiler_a_portable_build_is_used_or_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def no_compiler() -> str:
        raise library.NativeUnavailable("no C++ compiler on PATH")

    monkeypatch.setattr(library, "_compiler", no_compiler)
    with pytest.raises(library.NativeUnavailable, match="compiler"):
        library.load("latent_attention")
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    portable = library.build("latent_attention", portable=True)
    monkeypatch.setattr(library, "_compiler", no_compiler)
    if library._cpu_flags() >= library.PORTABLE_CPU_FLAGS:
        lib = library.load("latent_attention")
        assert lib._name == str(portable)
    # A CPU without AVX2/FMA never loads the x86-64-v3 build.
    monkeypatch.setattr(library, "_cpu_flags", lambda: {"sse2"})
    with pytest.raises(library.NativeUnavailable):
        library.load("latent_attention")


@needs_compiler
def test_an_unwritable_cache_is_reported_not_raised_as_oserror(tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")  # the cache directory would have to live under a file
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    with pytest.raises(library.NativeUnavailable, match="cannot write"):
        library.build("latent_attention")


def test_the_native_kernel_only_where_it_runs(tmp_path, monkeypatch) -> None:
    """A rank asked for the native kernel where it cannot run is a start-up error naming the
    setting; `auto` runs the torch kernel there and says why."""
    from common.loading.loader import load_model
    from common.native import latent_attention
    from common.parallel import ParallelConfig
    from common.runtime.kernel_choice import KernelUnavailable
    from services.decode.rank.backends import decode_backend, select_decode_kernel
    from services.decode.rank.rank_model import RankModel
    from tests.tiny import save_hf

    save_hf("v2-greedy", tmp_path, std=0.05)
    full = load_model(tmp_path)
    cpu = torch.device("cpu")
    if latent_attention.available():
        native = decode_backend(select_decode_kernel("native", cpu, torch.float32).kernel)
        model = RankModel(full, ParallelConfig(tp=2, latent_groups=2), 0, backend=native)
        assert model.backend.name == "native"
        torch_ = decode_backend(select_decode_kernel("torch", cpu, torch.float32).kernel)
        assert model.use_backend(torch_).name == "torch"
    monkeypatch.setattr(latent_attention, "available", lambda: False)
    with pytest.raises(KernelUnavailable, match=r"TPLA_DECODE_KERNEL=native: .*latent_attention"):
        select_decode_kernel("native", cpu, torch.float32)
    auto = select_decode_kernel("auto", cpu, torch.float32)
    assert auto.kernel == "torch" and [name for name, _ in auto.passed_over] == ["native"]
    assert "native cannot run here" in auto.describe()
