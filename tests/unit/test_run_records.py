"""Run records (dllm_common/runs.py): a damaged record hides only itself and names its file."""

import contextlib

import pytest
from conftest import ROOT

from dllm_common.runs import RunRecord, UnreadableRecord, find_record, read_records
from flows.cli import main


def _record(workdir, run_id, status="COMPLETED"):
    record = RunRecord(
        run_id=run_id,
        pipeline="smoke",
        config_path="configs/smoke.yaml",
        overrides=[],
        config={},
        config_sha256="0" * 64,
        status=status,
        pid=None,
    )
    record.stage("train[mdlm]").status = "COMPLETED"
    record.save(workdir)
    return record


def test_a_truncated_record_is_named_and_the_others_still_list(tmp_path, capsys):
    _record(tmp_path, "20261201-000000-aaaaaa")
    broken = _record(tmp_path, "20261201-000001-bbbbbb").path(tmp_path)
    broken.write_text(broken.read_text()[:40])
    records, unreadable = read_records(tmp_path)
    assert [r.run_id for r in records] == ["20261201-000000-aaaaaa"]
    assert len(unreadable) == 1 and str(broken) in unreadable[0] and "is unreadable (JSONDecodeError" in unreadable[0]
    with contextlib.chdir(ROOT):
        assert main(["runs", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert "20261201-000000-aaaaaa  COMPLETED" in out.out and "train[mdlm]" in out.out
    assert out.err.count("[dllm-flow] skipped: run record") == 1 and "Traceback" not in out.err
    with pytest.raises(UnreadableRecord, match="20261201-000001-bbbbbb.json is unreadable"):
        find_record(tmp_path, "20261201-000001-bbbbbb")


def test_a_late_save_from_another_thread_never_overwrites_a_newer_state(tmp_path, monkeypatch):
    """A fanned-out strategy's thread saving the record (serialized while the run was RUNNING, its write still
    under way) and the main thread ending the run FAILED: the file ends FAILED, whatever the timing."""
    import json
    import threading

    import dllm_common.runs as runs

    record = RunRecord(
        run_id="r1",
        pipeline="smoke",
        config_path="configs/smoke.yaml",
        overrides=[],
        config={},
        config_sha256="0" * 64,
        status="RUNNING",
        pid=None,
    )
    first, release, write = threading.Event(), threading.Event(), runs.atomic_write_text

    def slow_first_write(path, text):
        if not first.is_set():
            first.set()
            release.wait(10)  # the strategy thread's write is slow
        write(path, text)

    monkeypatch.setattr(runs, "atomic_write_text", slow_first_write)
    late = threading.Thread(target=record.save, args=(tmp_path,))
    late.start()
    first.wait(10)
    record.status = "FAILED"
    ending = threading.Thread(target=record.save, args=(tmp_path,))
    ending.start()
    ending.join(0.5)  # without the save lock the main thread's write lands first
    release.set()
    late.join(10)
    ending.join(10)
    assert json.loads(record.path(tmp_path).read_text())["status"] == "FAILED"
