"""benchmarks/contention.py end to end on a tiny model: quiet and contended rows, the neighbour processes gone
afterwards, the JSON record."""

import json

from benchmarks import contention


def test_rows_and_record(tmp_path, monkeypatch):
    started = []
    real = contention.neighbours
    monkeypatch.setattr(contention, "neighbours", lambda n: started.extend(real(n)) or started[-n:])
    out = tmp_path / "c.json"
    assert contention.main(["--recipes", "llama-tiny", "--steps", "3", "--rounds", "1", "--threads", "1",
                            "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["condition"] for r in rows] == ["quiet", "contended"]
    assert all(r["ms_min"] <= r["ms_med"] <= r["ms_max"] for r in rows)
    assert rows[0]["med/quiet_min"] == rows[0]["med/min"] and isinstance(rows[1]["goal_met"], bool)
    assert len(started) == 1 and started[0].poll() is not None  # the neighbour was killed
