"""`python -m hybrid.tools.traffic`: a run's traffic.json printed and drawn; bad input is one line, exit 2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hybrid.tools import traffic

DOC = {"unit": "bytes per step", "step": 4, "world": 3, "node_of": [0, 0, 1],
       "matrices": {"dp": [[0, 2e6, 0], [0, 0, 2e6], [2e6, 0, 0]], "pp": [[0, 1e6, 0], [0, 0, 0], [0, 0, 0]]}}


@pytest.fixture
def path(tmp_path: Path) -> Path:
    doc = dict(DOC)
    m = doc["matrices"]
    doc["matrices"] = {**m, "total": [[m["dp"][r][c] + m["pp"][r][c] for c in range(3)] for r in range(3)]}
    p = tmp_path / "traffic.json"
    p.write_text(json.dumps(doc))
    return p


def test_prints_the_matrix_with_sent_totals_and_draws_it(path: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "map.png"
    assert traffic.main([str(path), "--group", "dp", "--png", str(png)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [ln.split() for ln in lines if re.match(r"\s*r\d+\s+\d", ln)]
    assert len(rows) == 3
    for r, cells in enumerate(rows):  # each row's "sent" column is the row's sum in MB
        assert float(cells[-1]) == pytest.approx(sum(DOC["matrices"]["dp"][r]) / 1e6)
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, needle", [
    (["/nonexistent/traffic.json"], "cannot read"),
    (["{path}", "--group", "tp"], "group 'tp' has no traffic"),
    (["{path}", "--png"], "--png needs a value"),
    ([], "expected one traffic.json path"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], needle: str, path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert traffic.main([a.format(path=path) for a in args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hybrid: error:") and needle in err[0]
