"""scripts/uv_options.py: pip's configuration as uv's flags, and a refusal (setup.sh then installs
with pip) for any pip setting it does not translate."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "uv_options", Path(__file__).resolve().parents[1] / "scripts" / "uv_options.py")
uv_options = importlib.util.module_from_spec(spec)
spec.loader.exec_module(uv_options)


def test_pip_settings_become_uv_flags_and_environment():
    settings = {"find-links": "/w1 /w2", "extra-index-url": "file:///a/simple file:///b/simple",
                "constraint": "/etc/c.txt", "index-url": "https://mirror/simple",
                "cert": "/etc/ca.crt", "default-timeout": "180", "disable-pip-version-check": "1"}
    assert uv_options.uv_options(settings) == [
        "--extra-index-url", "https://mirror/simple",  # pip's main index first
        "--constraint", "/etc/c.txt",
        "--extra-index-url", "file:///a/simple", "--extra-index-url", "file:///b/simple",
        "--find-links", "/w1", "--find-links", "/w2",
        "--index-url", "https://mirror/simple",
        "--index-strategy", "unsafe-best-match"]
    assert uv_options.uv_options({})[:2] == ["--extra-index-url", "https://pypi.org/simple"]
    assert uv_options.uv_environment(settings) == ["SSL_CERT_FILE=/etc/ca.crt", "UV_HTTP_TIMEOUT=180"]


def test_pips_cache_folder_holds_uvs_cache_and_no_cache_means_none():
    assert uv_options.uv_options({"cache-dir": "/c/pip"}) == uv_options.uv_options({})
    assert uv_options.uv_environment({"cache-dir": "/c/pip"}) == ["UV_CACHE_DIR=/c/pip/uv"]
    assert uv_options.uv_environment({"cache-dir": "/c/pip", "no-cache-dir": "off"}) == [
        "UV_NO_CACHE=1"]


@pytest.mark.parametrize("name", ["no-index", "only-binary", "pre", "require-hashes"])
def test_a_setting_without_translation_is_refused(name):
    with pytest.raises(ValueError, match=name):
        uv_options.uv_options({name: "1"})


def test_environment_variables_override_the_files(monkeypatch):
    monkeypatch.setenv("PIP_FIND_LINKS", "/from-env")
    assert uv_options.pip_settings()["find-links"] == "/from-env"
