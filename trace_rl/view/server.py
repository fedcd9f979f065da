"""``trace view`` as a local web server (stdlib ``http.server``, 127.0.0.1 only).

Each request opens the published database read-only, renders the page and closes it again, so
the server holds nothing between requests and never delays a run that is writing (it sees the
snapshot as of the writer's last publish; reload for newer rows).

    GET /                      the newest run, its newest step
    GET /?run=R&step=N         run R, step N (either may be left out)
    GET /healthz               "ok"
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable
from urllib.parse import parse_qs, urlencode, urlsplit

from trace_rl.view.data import ViewError, open_store, page_data
from trace_rl.view.page import render

HOST = "127.0.0.1"
DEFAULT_PORT = 8765
"""``trace view``'s port unless told another ``--port``."""


def page_url(run: str | None = None, step: int | None = None, host: str = HOST,
             port: int = DEFAULT_PORT) -> str:
    """The URL of the page of ``run`` and ``step`` (either left out: the newest)."""
    query = urlencode([(k, v) for k, v in (("run", run), ("step", step)) if v is not None])
    return f"http://{host}:{port}/{'?' + query if query else ''}"


def make_server(workdir: str | Path, port: int = 0) -> ThreadingHTTPServer:
    """A server of the work dir's pages on 127.0.0.1:``port`` (0: a free port), not yet
    serving (call ``serve_forever``; ``server_address`` has the port)."""
    workdir = Path(workdir)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            url = urlsplit(self.path)
            if url.path == "/healthz":
                return self._send(200, "text/plain; charset=utf-8", "ok\n")
            if url.path not in ("/", "/index.html"):
                return self._send(404, "text/plain; charset=utf-8", f"no page {url.path}\n")
            args = parse_qs(url.query)
            run = (args.get("run") or [None])[0] or None
            step_arg = (args.get("step") or [None])[0]
            try:
                step = None if step_arg in (None, "") else int(step_arg)
            except ValueError:
                return self._send(400, "text/plain; charset=utf-8",
                                  f"trace view: step {step_arg!r} is not an integer\n")
            try:
                html = render(page_data(open_store(workdir), run, step))
            except ViewError as exc:
                return self._send(404, "text/plain; charset=utf-8", f"trace view: {exc}\n")
            self._send(200, "text/html; charset=utf-8", html)

        def _send(self, code: int, kind: str, body: str) -> None:
            raw = body.encode("utf-8")
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(raw)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, fmt: str, *args: object) -> None:  # quiet: the CLI says the URL
            pass

    server = ThreadingHTTPServer((HOST, port), Handler)
    server.daemon_threads = True
    return server


def serve(workdir: str | Path, port: int, run: str | None, step: int | None,
          say: Callable[[str], None] = print) -> None:
    """Check that the page of (run, step) renders, then serve until interrupted."""
    page_data(open_store(workdir), run, step)  # bad input fails here, before the port opens
    try:
        server = make_server(workdir, port)
    except OSError as exc:
        raise ViewError(f"cannot listen on {HOST}:{port} ({exc.strerror or exc}); "
                        "pick another --port") from exc
    host, bound = server.server_address[:2]
    say(f"trace view: serving {page_url(run, step, host, bound)} (read-only; Ctrl-C to stop)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def serve_in_thread(workdir: str | Path, port: int = 0) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """For embedding (tests, notebooks): a started server and its thread; stop with
    ``server.shutdown()``."""
    server = make_server(workdir, port)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread
