"""`osd draft curve`: agreement against warm-start tokens from published heads' draft.json."""

import json

from pipeline.cli import main


def _head(tmp_path, name, tokens, agree):
    d = tmp_path / name
    d.mkdir()
    (d / "draft.json").write_text(json.dumps({
        "lineage": {"family": "head", "teacher_records": tokens // 100, "conversations": 0},
        "metrics": {"train_tokens": tokens, "agree_per_depth": agree, "tokens_per_step_est": 1.5}}))
    return str(d)


def test_points_sorted_by_tokens_in_json_and_png(tmp_path, capsys):
    big = _head(tmp_path, "big", 400_000, [0.45, 0.42, 0.4])
    small = _head(tmp_path, "small", 180_000, [0.40, 0.38, 0.37])
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    assert main(["draft", "curve", big, small, "--json", str(out), "--png", str(png)]) == 0
    points = json.loads(out.read_text())["points"]
    assert [p["train_tokens"] for p in points] == [180_000, 400_000]
    assert [p["depth1"] for p in points] == [0.40, 0.45]
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "400000 tokens  agreement 0.450 / 0.420 / 0.400" in capsys.readouterr().out


def test_a_directory_that_is_not_a_head_is_refused(tmp_path, capsys):
    layer = tmp_path / "layer"
    layer.mkdir()
    (layer / "draft.json").write_text(json.dumps({"lineage": {}, "metrics": {}}))
    assert main(["draft", "curve", str(layer), str(tmp_path / "missing"), "--png", "none",
                 "--json", str(tmp_path / "c.json")]) == 2
    assert "not a warm-started head" in capsys.readouterr().err
