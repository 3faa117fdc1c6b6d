"""`kunserve profile` end to end on a tiny grid (behaviour only: the file it writes and what it prints)."""

from __future__ import annotations

import pytest

from kunserve.cli.main import main
from kunserve.shared.profile_files import read_profiles


def test_profile_command_writes_a_profile_and_reports_heldout_error(tmp_path, capsys):
    out = tmp_path / "prof.json"
    main(["profile", "--quick", "--max-len", "160", "--repeats", "1", "--threads", "1", "--layers", "1-3",
          "--out", str(out)])
    text = capsys.readouterr().out
    assert "held-out" in text and "kunserve" in text and "conserve" in text and str(out) in text
    (key, prof), = read_profiles(out).items()
    assert prof.layers == (1, 3) and key.startswith("kunserve-tiny/float32/layers=1-3/cpu[") and key.endswith("x1t")
    assert prof.fit["heldout_points"] > 0 and len(prof.samples) == prof.fit["train_points"] + prof.fit["heldout_points"]


@pytest.mark.parametrize("args,msg", [(["--layers", "3-1"], "START < END"), (["--layers", "0-9"], "has 4 layers"),
                                      (["--threads", "0"], "threads")])
def test_profile_command_rejects_bad_arguments(tmp_path, capsys, args, msg):
    with pytest.raises(SystemExit) as exc:
        main(["profile", "--quick", "--out", str(tmp_path / "p.json"), *args])
    assert exc.value.code != 0
    assert msg in capsys.readouterr().err
