"""bench/tp.py refuses bad --mixed options before it computes or starts anything: a usage error (exit 2) naming the option."""

from __future__ import annotations

import pytest
from scripts_loader import load_script


def _bench():
    return load_script("bench/tp.py", "bench_tp_args")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--configs", "elastic,tp3"], "--configs: unknown tp3"),
        (["--configs", ","], "--configs: unknown (none given)"),
        (["--duration", "0"], "--duration must be > 0"),
        (["--duration", "nan"], "--duration must be > 0"),
        (["--rate", "-1"], "--rate must be > 0"),
        (["--rate", "0.01", "--duration", "10"], "at least one short request"),
        (["--longs", "-1"], "--longs must be 0 to 8"),
        (["--longs", "9"], "--longs must be 0 to 8"),
        (["--idle-split-s", "0"], "--idle-split-s must be > 0"),
    ],
)
def test_bad_mixed_options_are_usage_errors(args, message, capsys):
    for mixed in (["--mixed"], []):
        with pytest.raises(SystemExit) as exc:
            _bench().main([*mixed, *args])
        assert exc.value.code == 2
        out = capsys.readouterr()
        assert message in out.err, out.err
        assert "Page-aligned" not in out.out  # nothing computed
