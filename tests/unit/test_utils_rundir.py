"""Run folders: a named run reuses its folder (resume), an unnamed one never shares another run's."""

import time

from empo2.utils import make_run_dir


def test_unnamed_runs_started_in_the_same_second_get_their_own_folders(tmp_path, monkeypatch):
    monkeypatch.setattr(time, "strftime", lambda fmt: "20261203-190328")
    dirs = [make_run_dir(str(tmp_path / "runs"), None) for _ in range(3)]
    assert [d.name for d in dirs] == ["20261203-190328", "20261203-190328-2", "20261203-190328-3"]
    assert all(d.is_dir() for d in dirs)


def test_a_named_run_reuses_its_folder(tmp_path):
    first = make_run_dir(str(tmp_path), "cut")
    (first / "marker").write_text("kept")
    assert make_run_dir(str(tmp_path), "cut") == first
    assert (first / "marker").read_text() == "kept"
