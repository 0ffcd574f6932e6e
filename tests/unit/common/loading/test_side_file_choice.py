"""TPLA_REPARAM's values: `auto` prefers tpla_pca.json and falls back to the identity basis with
one warning, `none` / empty read nothing, a named side file is required; the services' configs,
the prefix cache's identity and the loader all read the same choice."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from common.kv.prefix_cache import model_identity
from common.loading.serving_model import open_serving_weights
from common.loading.side_file_choice import resolve_reparam, side_file_path
from common.runtime.settings import load_settings
from services.decode.config import engine_config
from services.prefill.config import prefill_config

DEMO = Path(__file__).resolve().parents[4] / "models" / "demo"


@pytest.fixture
def downloaded(tmp_path: Path) -> Path:
    """The demo as a freshly downloaded checkpoint: no tpla_*.json."""
    out = tmp_path / "demo"
    shutil.copytree(DEMO, out, ignore=shutil.ignore_patterns("tpla_*.json"))
    return out


def test_values(downloaded: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert resolve_reparam(DEMO, "auto") == "tpla_pca"
        assert resolve_reparam(DEMO, "tpla_hadamard") == "tpla_hadamard"
        assert resolve_reparam(DEMO, "tpla_identity.json") == "tpla_identity.json"
        for nothing in (None, "", "none", "None", " none "):
            assert resolve_reparam(DEMO, nothing) is None
    assert not caplog.records  # nothing was missing
    with caplog.at_level(logging.WARNING):
        assert resolve_reparam(downloaded, "auto") is None
    [record] = caplog.records
    assert "no TPLA side file" in record.message and "identity basis" in record.message
    assert str(side_file_path(downloaded, "tpla_pca")) in record.message
    with pytest.raises(FileNotFoundError, match=r"TPLA_REPARAM=tpla_pca: .*tpla_pca\.json"):
        resolve_reparam(downloaded, "tpla_pca")
    with pytest.raises(FileNotFoundError, match=r"mine\.json"):
        resolve_reparam(DEMO, "mine.json")


def test_configs_carry_the_choice(downloaded: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert engine_config(load_settings(model=str(DEMO))).reparam == "tpla_pca"
    assert prefill_config(load_settings(model=str(DEMO))).group.reparam == "tpla_pca"
    for value in ("none", ""):
        s = load_settings(model=str(DEMO), reparam=value)
        assert engine_config(s).reparam is None and prefill_config(s).group.reparam is None
    with caplog.at_level(logging.WARNING):
        s = load_settings(model=str(downloaded))
        assert engine_config(s).reparam is None
    assert len(caplog.records) == 1
    named = load_settings(model=str(downloaded), reparam="tpla_pca")
    with pytest.raises(FileNotFoundError, match=r"tpla_pca\.json"):
        engine_config(named)
    with pytest.raises(FileNotFoundError, match=r"tpla_pca\.json"):
        prefill_config(named)


def test_identity_and_loader_agree(downloaded: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`none` is no side file on every path (the prefix cache's identity looked for
    none.json), and `auto` where there is none is the identity basis, not a crash."""
    none = model_identity(downloaded, None)
    assert model_identity(downloaded, "none") == model_identity(downloaded, "") == none
    with caplog.at_level(logging.WARNING):
        assert model_identity(downloaded, "auto") == none
        _, spectra = open_serving_weights(downloaded, "auto")
    assert spectra == [None] * 4
    assert (
        model_identity(DEMO, "auto")
        == model_identity(DEMO, "tpla_pca")
        != model_identity(DEMO, "none")
    )
    _, spectra = open_serving_weights(DEMO, "none")
    assert spectra == [None] * 4
    with pytest.raises(FileNotFoundError, match=r"tpla_pca\.json"):
        model_identity(downloaded, "tpla_pca")
    with pytest.raises(FileNotFoundError, match=r"tpla_pca\.json"):
        open_serving_weights(downloaded, "tpla_pca")
