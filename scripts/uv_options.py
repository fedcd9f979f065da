"""Print, one per line, the `uv pip install` options that make uv install what `pip install`
would here: pip's own configuration (files and PIP_* variables: indexes, find-links, global
constraints) turned into uv's flags, read at run time. scripts/setup.sh uses uv only when this
succeeds; it exits 1, naming the option, when pip's configuration holds something it does not
translate, and setup.sh then installs with pip.

pip pools every index's files of a version and takes the best wheel for this interpreter; uv
takes a version's files from the first index that has the version. So pip's main index (PyPI
unless configured) comes first: it carries every wheel of a release, and uv then picks among
them as pip does (the extra indexes, mirrors with some of those files, come after it).

Usage: python scripts/uv_options.py [--env]   (run by the venv's python, whose pip is read);
--env prints the environment variables instead (VAR=value lines, for `env`)."""

from __future__ import annotations

import os
import shlex
import sys

# pip option -> uv flag, for options whose value is a list of whitespace-separated items.
LISTS = {"extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
# Options that change nothing uv resolves or installs (certificates, time-outs and the cache
# folder become environment variables in setup.sh, the others are pip's own chatter).
IGNORED = {"cert", "default-timeout", "timeout", "disable-pip-version-check", "no-color",
           "progress-bar", "quiet", "verbose", "no-input", "retries", "root-user-action",
           "cache-dir", "no-cache-dir"}


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


def uv_options(settings: dict[str, str]) -> list[str]:
    from pip._internal.models.index import PyPI

    main = settings.get("index-url", PyPI.simple_url)
    # uv: --extra-index-url values come before --index-url, the earlier first
    out: list[str] = ["--extra-index-url", main]
    for name, value in sorted(settings.items()):
        if name in IGNORED or name == "index-url":
            continue
        if name in LISTS:
            for item in shlex.split(value):
                out += [LISTS[name], item]
        else:
            raise ValueError(f"pip option {name}={value!r} has no uv translation here")
    # pip takes the best version across every index and find-links directory; uv's default is the
    # first index that has the package at all.
    return out + ["--index-url", main, "--index-strategy", "unsafe-best-match"]


def uv_environment(settings: dict[str, str]) -> list[str]:
    out = []
    if settings.get("cert"):
        out.append(f"SSL_CERT_FILE={settings['cert']}")
    timeout = settings.get("timeout") or settings.get("default-timeout")
    if timeout:
        out.append(f"UV_HTTP_TIMEOUT={int(float(timeout))}")
    if "no-cache-dir" in settings:  # pip: any value turns its cache off
        out.append("UV_NO_CACHE=1")
    elif settings.get("cache-dir"):  # uv's cache beside pip's, where pip was told to keep its own
        out.append(f"UV_CACHE_DIR={os.path.join(os.path.expanduser(settings['cache-dir']), 'uv')}")
    return out


def main() -> int:
    try:
        settings = pip_settings()
        options = uv_environment(settings) if sys.argv[1:] == ["--env"] else uv_options(settings)
    except Exception as exc:  # noqa: BLE001 (any doubt: setup.sh installs with pip)
        print(f"uv_options: {exc}", file=sys.stderr)
        return 1
    print("\n".join(options))
    return 0


if __name__ == "__main__":
    sys.exit(main())
