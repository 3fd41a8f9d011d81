"""benchmarks/cpu_benchmark.py: a tiny run prints agreeing rows; bad arguments exit clearly."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cpu_benchmark  # noqa: E402

TINY = ["--hidden", "12", "--batch", "2", "--steps", "5", "--repeats", "1", "--rounds", "1"]


@pytest.mark.parametrize("density", ["0", "0.3"])
def test_tiny_run_rows_agree(capsys, density):
    cpu_benchmark.main([*TINY, "--density", density, "--cells", "lstm,gru"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[0] for r in rows] == ["lstm", "gru"]
    for row in rows:
        assert float(row[6]) < 1e-5  # sparse against dense, relative difference


@pytest.mark.parametrize("bad", [["--hidden", "0"], ["--rounds", "0"], ["--density", "2"],
                                 ["--cells", "lstm,mgu"], ["--dtype", "float64"]])
def test_bad_arguments_exit(capsys, bad):
    with pytest.raises(SystemExit):
        cpu_benchmark.main([*TINY, *bad])
    assert bad[0] in capsys.readouterr().err
