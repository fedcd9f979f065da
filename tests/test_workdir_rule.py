"""One rule decides the work dir for every command and flow (``trace_rl.environ.resolve_workdir``):
no second copy of it in the CLI, the flows or the deployments."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_one_rule_resolves_the_work_dir(monkeypatch, tmp_path):
    copies = [str(p.relative_to(ROOT)) for pkg in ("cli", "flows", "tasks", "deployments", "trace_rl")
              for p in (ROOT / pkg).rglob("*.py")
              if re.search(r"""(getenv\(|environ\.get\(|environ\[)\s*["']TRACE_WORKDIR""",
                           p.read_text()) and p.name != "environ.py"]
    assert copies == []
    from cli.prepare import resolve_workdir as cli_rule
    from flows.common import prepare_workdir
    from trace_rl.environ import resolve_workdir

    assert cli_rule is resolve_workdir
    monkeypatch.setenv("TRACE_WORKDIR", str(tmp_path / "from-env"))
    assert resolve_workdir(None) == str(tmp_path / "from-env")
    assert not (tmp_path / "from-env").exists()  # the rule creates nothing
    assert prepare_workdir(None) == str(tmp_path / "from-env") and (tmp_path / "from-env").is_dir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TRACE_WORKDIR")
    assert resolve_workdir(None) == str(tmp_path / "trace_runs")
    assert resolve_workdir("x") == str(tmp_path / "x")
