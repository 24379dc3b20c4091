"""How run_workers starts its ranks (``ringcore._ranks``): forked from a server with torch
loaded, yet each rank gets what a rank spawned at the call would get — the caller's
environment then, its working directory, its stdout."""

from __future__ import annotations

import os

import pytest

from ringcore import _ranks
from ringcore.testing import run_workers


def _what_the_rank_sees() -> tuple[str | None, str | None, str, bool]:
    print(f"rank output {os.environ['RING_RANK']}", flush=True)
    return (
        os.environ.get("RING_TEST_MARK"),
        os.environ.get("RING_TEST_GONE"),
        os.getcwd(),
        "torch" in __import__("sys").modules,
    )


@pytest.mark.parametrize("start", ["forkserver", "spawn"])
def test_a_rank_sees_the_callers_environment_folder_and_stdout_at_the_call(
    start, tmp_path, monkeypatch, capfd
):
    monkeypatch.setenv("RING_RANK_START", start)
    monkeypatch.setenv("RING_TEST_GONE", "set before the server started")
    run_workers(_what_the_rank_sees, np=1)  # the server (if any) starts with this env
    monkeypatch.delenv("RING_TEST_GONE")
    monkeypatch.setenv("RING_TEST_MARK", "set after")
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    seen = run_workers(_what_the_rank_sees, np=2)
    assert [s[:3] for s in seen] == [("set after", None, str(tmp_path))] * 2
    out = capfd.readouterr().out
    assert "rank output 0" in out and "rank output 1" in out
    if start == "forkserver":
        assert all(s[3] for s in seen), "a forked rank starts with torch imported"


def test_an_unknown_way_to_start_ranks_is_refused_naming_the_choices(monkeypatch):
    monkeypatch.setenv("RING_RANK_START", "fork")
    with pytest.raises(ValueError, match=r"RING_RANK_START='fork'.*forkserver.*spawn"):
        _ranks.context()
