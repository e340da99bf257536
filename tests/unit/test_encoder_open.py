"""The encoder probe asked of a child process: the same answers as in this process, and what a child that cannot
answer makes of them."""

from __future__ import annotations

import pytest

from h3_core.media.encoder_open import fails_to_open, fails_to_open_elsewhere

pytest.importorskip("av")


def test_the_child_answers_as_this_process_would():
    names = ("libx264", "h264_missing", "h264_nvenc")
    here = {name: fails_to_open(name, 64, 32, 24) for name in names}
    assert here["libx264"] is None and here["h264_missing"].startswith("UnknownCodecError: ")
    assert fails_to_open_elsewhere(names, 64, 32, 24) == here
    # a size libx264 refuses (yuv420p needs an even width) fails there as here
    assert fails_to_open_elsewhere(["libx264"], 63, 32, 24) == {"libx264": fails_to_open("libx264", 63, 32, 24)}
    assert fails_to_open("libx264", 63, 32, 24) is not None


def _shadow_av(tmp_path, monkeypatch, source: str) -> None:
    """An ``av`` module first on the child's path, with ``source`` in it."""
    (tmp_path / "av.py").write_text(source)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))


def test_a_child_without_pyav_raises_import_error(tmp_path, monkeypatch):
    _shadow_av(tmp_path, monkeypatch, "raise ImportError('PyAV is not installed here')\n")
    with pytest.raises(ImportError, match="PyAV is not installed here"):
        fails_to_open_elsewhere(["h264_nvenc"], 256, 256, 24)


def test_a_child_that_dies_fails_every_name_with_its_exit_and_last_words(tmp_path, monkeypatch):
    _shadow_av(tmp_path, monkeypatch, "import os, sys\nsys.stderr.write('driver crashed\\n')\nos._exit(3)\n")
    answers = fails_to_open_elsewhere(["h264_nvenc", "libx264"], 256, 256, 24)
    assert answers == dict.fromkeys(["h264_nvenc", "libx264"], "the probe's process exited with 3 (driver crashed)")


def test_a_child_that_hangs_is_given_up_on(tmp_path, monkeypatch):
    from h3_core.media import encoder_open

    monkeypatch.setattr(encoder_open, "CHILD_TIMEOUT_S", 3)
    _shadow_av(tmp_path, monkeypatch, "import time\ntime.sleep(60)\n")
    answers = fails_to_open_elsewhere(["h264_nvenc"], 256, 256, 24)
    assert answers == {"h264_nvenc": "the probe's process did not answer within 3 s"}
