"""Settings: environment variables, overrides, messages a user understands, and a row for each in docs/settings.md."""

from __future__ import annotations

import re
import runpy

import pytest

from service.settings import Settings, SettingsError, load_settings

from servers import ROOT

GUNICORN_CONF = ROOT / "gunicorn.conf.py"


def test_environment_variables_are_read(monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTIZATION", "fp32")
    monkeypatch.setenv("MAX_NEW_TOKENS", "77")
    monkeypatch.setenv("IMAGE_MAX_PIXELS", "65536")
    s = load_settings(cache_dir=tmp_path)
    assert (s.quantization, s.max_new_tokens, s.image_max_pixels) == ("fp32", 77, 65536)


def test_overrides_win_over_the_environment(monkeypatch):
    monkeypatch.setenv("QUANTIZATION", "fp32")
    assert load_settings(quantization="int8").quantization == "int8"


def test_defaults_are_int8_and_a_cpu_sized_pixel_budget(monkeypatch):
    monkeypatch.delenv("QUANTIZATION", raising=False)
    monkeypatch.delenv("IMAGE_MAX_PIXELS", raising=False)
    s = load_settings()
    assert s.quantization == "int8" and s.model_path is None
    assert s.image_max_pixels <= 512 * 512


@pytest.mark.parametrize(
    "env,value,words",
    [
        ("QUANTIZATION", "int4", "QUANTIZATION"),
        ("THREADS", "zero", "THREADS"),
        ("MODEL_PATH", "/definitely/not/here", "is not a directory"),
    ],
)
def test_bad_values_give_readable_errors(monkeypatch, env, value, words):
    monkeypatch.setenv(env, value)
    with pytest.raises(SettingsError) as info:
        load_settings()
    assert words in str(info.value)


def test_model_dir_without_config_is_explained(monkeypatch, tmp_path):
    monkeypatch.setenv("MODEL_PATH", str(tmp_path))
    with pytest.raises(SettingsError, match="no config.json"):
        load_settings()


def test_gunicorn_config_takes_its_values_from_the_settings(monkeypatch, tmp_path):
    for name, value in {
        "BIND": "0.0.0.0:9001",
        "GRACEFUL_TIMEOUT": "7",
        "ACCESS_LOG": "1",
        "LOG_LEVEL": "WARNING",
        "MAX_BATCH_SIZE": "3",
        "QUEUE_SIZE": "5",
        "WORKERS": "4",
        "WEB_CONCURRENCY": "4",
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
    }.items():
        monkeypatch.setenv(name, value)
    config = runpy.run_path(str(GUNICORN_CONF))
    assert (config["bind"], config["graceful_timeout"], config["accesslog"], config["loglevel"]) == (
        "0.0.0.0:9001",
        7,
        "-",
        "warning",
    )
    assert config["threads"] == 3 + 5 + 3  # the batch, the queue, and room for /health, /metrics, 429s
    assert config["workers"] == 1  # one model per instance, whatever WORKERS / WEB_CONCURRENCY say
    monkeypatch.setenv("GRACEFUL_TIMEOUT", "soon")
    with pytest.raises(SettingsError, match="GRACEFUL_TIMEOUT"):
        runpy.run_path(str(GUNICORN_CONF))


def test_every_setting_has_its_row_in_the_settings_page():
    page = (ROOT / "docs" / "settings.md").read_text()
    missing = [name.upper() for name in Settings.model_fields if not re.search(rf"`{name.upper()}[`=]", page)]
    assert missing == []
