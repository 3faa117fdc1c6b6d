"""`kunserve up`'s HTTP-front options are checked before anything starts: a chat template that is missing or does
not compile is one line naming it and a non-zero exit, with no service process started."""

from __future__ import annotations

import subprocess
import sys


def _up(*args: str, cwd) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kunserve.cli.main", "up", "--run-dir", str(cwd / "run"), *args],
                          capture_output=True, text=True, timeout=60, cwd=cwd)


def test_a_missing_or_broken_chat_template_stops_up_before_it_starts(tmp_path):
    missing = _up("--chat-template", str(tmp_path / "nope.jinja"), cwd=tmp_path)
    assert missing.returncode != 0 and "--chat-template" in missing.stderr and "nope.jinja" in missing.stderr
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    out = _up("--chat-template", str(broken), cwd=tmp_path)
    assert out.returncode != 0 and "broken.jinja" in out.stderr and "line 1" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists(), "nothing may start (or leave a run directory) before the check"
