"""scripts/pip_to_uv.py: the files of pip's install report, for uv to install as they are, and a
refusal (setup.sh then installs with pip) for anything else in the report."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "pip_to_uv", Path(__file__).resolve().parents[1] / "scripts" / "pip_to_uv.py")
pip_to_uv = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pip_to_uv)


def _item(name: str, info: dict) -> dict:
    return {"metadata": {"name": name, "version": "1.0"}, "download_info": info}


def test_the_reports_files_are_named_by_url_and_editables_left_to_pip():
    report = {"install": [
        _item("torch", {"url": "file:///w/torch-2.13.0%2Bcpu-cp311-cp311-linux_x86_64.whl",
                        "archive_info": {"hashes": {"sha256": "ab"}}}),
        _item("trl", {"url": "https://files.example/trl-1.16.0-py3-none-any.whl",
                      "archive_info": {}}),
        _item("trace-rl", {"url": "file:///repo", "dir_info": {"editable": True}})]}
    assert pip_to_uv.requirements(report) == [
        "torch @ file:///w/torch-2.13.0%2Bcpu-cp311-cp311-linux_x86_64.whl",
        "trl @ https://files.example/trl-1.16.0-py3-none-any.whl"]


@pytest.mark.parametrize("info", [
    {"url": "https://git.example/x.git", "vcs_info": {"vcs": "git", "commit_id": "ab"}},
    {"url": "file:///src/x", "dir_info": {}}])
def test_anything_but_a_file_or_an_editable_is_refused(info):
    with pytest.raises(ValueError, match="x"):
        pip_to_uv.requirements({"install": [_item("x", info)]})


def test_pips_certificate_and_time_out_become_uvs_variables():
    assert pip_to_uv.uv_environment({"cert": "/etc/ca.crt", "default-timeout": "180"}) == [
        "SSL_CERT_FILE=/etc/ca.crt", "UV_HTTP_TIMEOUT=180"]
    assert pip_to_uv.uv_environment({}) == []


def test_environment_variables_override_pips_files(monkeypatch):
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "7")
    assert pip_to_uv.pip_settings()["default-timeout"] == "7"
