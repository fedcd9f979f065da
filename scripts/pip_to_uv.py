"""What scripts/setup.sh hands uv, read from pip at run time, so that uv installs exactly the files
pip would have installed:

    python scripts/pip_to_uv.py requirements REPORT   # pip's `install --dry-run --report` as
                                                      # `name @ url` lines (editables left out)
    python scripts/pip_to_uv.py env                   # pip's certificate and time-out as uv's
                                                      # environment variables (VAR=value lines)

pip resolves (its indexes, find-links, constraints and its choice among a version's wheels); uv
only downloads, unpacks and byte-compiles those files, in parallel. Anything in the report that is
not a file to install as is (a VCS checkout, a local directory that is not editable) exits 1, and
setup.sh then installs with pip."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def requirements(report: dict) -> list[str]:
    """``name @ url`` for every file pip would install; editable directories are left to pip."""
    out = []
    for item in report["install"]:
        info = item["download_info"]
        name = item["metadata"]["name"]
        if info.get("dir_info", {}).get("editable"):
            continue
        if "archive_info" not in info:
            raise ValueError(f"{name}: {info.get('url')} is not an archive pip downloads as is")
        out.append(f"{name} @ {info['url']}")
    return out


def pip_settings() -> dict[str, str]:
    """pip install's effective settings: PIP_* variables over the [install] section over
    [global], each file over the ones pip reads before it."""
    from pip._internal.configuration import Configuration

    conf = Configuration(isolated=False)
    conf.load()
    found: dict[str, str] = {}
    for section in ("global", "install", ":env:"):
        for key, value in conf.items():
            scope, _, name = key.partition(".")
            if scope == section:
                found[name] = value
    return found


def uv_environment(settings: dict[str, str]) -> list[str]:
    out = []
    if settings.get("cert"):
        out.append(f"SSL_CERT_FILE={settings['cert']}")
    timeout = settings.get("timeout") or settings.get("default-timeout")
    if timeout:
        out.append(f"UV_HTTP_TIMEOUT={int(float(timeout))}")
    return out


def main(argv: list[str]) -> int:
    try:
        if argv[:1] == ["requirements"] and len(argv) == 2:
            lines = requirements(json.loads(Path(argv[1]).read_text()))
        elif argv == ["env"]:
            lines = uv_environment(pip_settings())
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except Exception as exc:  # noqa: BLE001 (any doubt: setup.sh installs with pip)
        print(f"pip_to_uv: {exc}", file=sys.stderr)
        return 1
    if lines:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
