"""`last.ckpt` is a link to the newest iteration checkpoint: one full write per checkpoint, and resume
reads only the files themselves."""

import os
from types import SimpleNamespace

import torch

from empo2.lit.checkpoint_io import LAST, IterationCheckpoint, point_link
from empo2.workflows.train import checkpoint_files, find_resume_checkpoint


def _touch(path, mtime):
    path.write_bytes(b"x")
    os.utime(path, (mtime, mtime))


def test_checkpoints_are_written_without_record_checksums_and_read_back_whole(tmp_path):
    import zipfile

    from empo2.lit.checkpoint_io import AtomicCheckpointIO

    state = {"weights": torch.randn(64, 64), "step": 3}
    AtomicCheckpointIO().save_checkpoint(state, tmp_path / "a.ckpt")
    assert all(info.CRC == 0 for info in zipfile.ZipFile(tmp_path / "a.ckpt").infolist())  # none computed
    loaded = torch.load(tmp_path / "a.ckpt", weights_only=True)
    assert torch.equal(loaded["weights"], state["weights"]) and loaded["step"] == 3
    assert torch.serialization.get_crc32_options()  # the process-wide setting is left as it was


def test_point_link_replaces_a_link_or_an_old_full_copy_with_a_relative_link(tmp_path):
    (tmp_path / "iter-epoch=0000.ckpt").write_bytes(b"a")
    (tmp_path / "iter-epoch=0001.ckpt").write_bytes(b"b")
    (tmp_path / LAST).write_bytes(b"a full copy, as runs wrote it before")
    point_link(tmp_path / LAST, "iter-epoch=0000.ckpt")
    assert os.readlink(tmp_path / LAST) == "iter-epoch=0000.ckpt"
    point_link(tmp_path / LAST, "iter-epoch=0001.ckpt")
    assert os.readlink(tmp_path / LAST) == "iter-epoch=0001.ckpt"
    assert (tmp_path / LAST).read_bytes() == b"b"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter-epoch=0000.ckpt", "iter-epoch=0001.ckpt", LAST]  # no temp link left behind


def test_checkpoint_files_are_the_files_newest_first_never_a_link(tmp_path):
    _touch(tmp_path / "iter-epoch=0000.ckpt", 1e9)
    _touch(tmp_path / "iter-epoch=0001.ckpt", 2e9)
    os.symlink("iter-epoch=0001.ckpt", tmp_path / LAST)
    os.symlink("gone.ckpt", tmp_path / "dangling.ckpt")  # a target set aside as unreadable
    assert checkpoint_files(tmp_path) == [tmp_path / "iter-epoch=0001.ckpt", tmp_path / "iter-epoch=0000.ckpt"]
    old_run = tmp_path / "old"  # a run folder written when last.ckpt was a full copy: that file counts
    old_run.mkdir()
    _touch(old_run / "iter-epoch=0000.ckpt", 1e9)
    _touch(old_run / LAST, 1e9 + 1)
    assert checkpoint_files(old_run) == [old_run / LAST, old_run / "iter-epoch=0000.ckpt"]


def test_a_damaged_newest_checkpoint_behind_last_falls_back_to_the_one_before(tmp_path, capsys):
    torch.save({"epoch": 0}, tmp_path / "iter-epoch=0000.ckpt")
    torch.save({"epoch": 1}, tmp_path / "iter-epoch=0001.ckpt")
    os.utime(tmp_path / "iter-epoch=0000.ckpt", (1e9, 1e9))
    point_link(tmp_path / LAST, "iter-epoch=0001.ckpt")
    data = (tmp_path / LAST).read_bytes()
    (tmp_path / LAST).write_bytes(data[: len(data) // 2])  # writes through the link: the newest file is torn
    assert find_resume_checkpoint(tmp_path) == tmp_path / "iter-epoch=0000.ckpt"
    out = capsys.readouterr().out
    assert out.startswith(f"checkpoint {tmp_path / 'iter-epoch=0001.ckpt'} is unreadable")
    assert LAST not in out  # the link itself is never tried
    assert (tmp_path / "iter-epoch=0001.ckpt.unreadable").is_file()


def _fake_trainer(saved: list, epoch: int, global_zero: bool = True):
    def save_checkpoint(path, weights_only):
        assert weights_only is False  # the whole training state, and said so: Lightning logs a default
        path.write_bytes(b"state")
        saved.append(path.name)

    return SimpleNamespace(current_epoch=epoch, is_global_zero=global_zero, save_checkpoint=save_checkpoint)


def test_every_nth_iteration_is_written_once_and_last_names_it(tmp_path):
    cb, saved = IterationCheckpoint(tmp_path, every=2), []
    for epoch in range(5):
        cb.on_train_epoch_end(_fake_trainer(saved, epoch), None)
    assert saved == ["iter-epoch=0001.ckpt", "iter-epoch=0003.ckpt"]
    assert os.readlink(tmp_path / LAST) == "iter-epoch=0003.ckpt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter-epoch=0001.ckpt", "iter-epoch=0003.ckpt", LAST]


def test_only_rank_zero_points_the_link(tmp_path):
    saved = []
    IterationCheckpoint(tmp_path, every=1).on_train_epoch_end(_fake_trainer(saved, 0, global_zero=False), None)
    assert saved == ["iter-epoch=0000.ckpt"] and not (tmp_path / LAST).exists()
