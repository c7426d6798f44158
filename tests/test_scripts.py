"""The shell scripts under tests/ that run on a GPU machine, checked here on their plumbing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")


def _run_gpu_tests(tmp_path: Path, **env: str) -> tuple[int, list[str]]:
    full = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), **env}
    proc = subprocess.run(["bash", str(ROOT / "tests" / "run_gpu_tests.sh"), str(tmp_path)], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=600)
    return proc.returncode, (tmp_path / "summary.txt").read_text().splitlines()


def test_run_gpu_tests_writes_a_row_per_file_with_pytests_line(tmp_path):
    # One GPU-marked test that this machine skips without a GPU (and runs with one): status ok either way.
    rc, lines = _run_gpu_tests(tmp_path, GPU_TEST_FILES="test_triton_launch.py")
    rows = [line for line in lines if line.startswith("test_")]
    assert rc == 0, lines
    assert len(rows) == 1 and rows[0].split()[:2] == ["test_triton_launch.py", "ok"], rows
    assert ("skipped" in rows[0] or "passed" in rows[0]) and (tmp_path / "test_triton_launch.log").exists()
    assert any(line.startswith("torch ") for line in lines) and any(line.startswith("commit ") for line in lines)


def test_run_gpu_tests_counts_files_past_the_deadline_as_not_reached(tmp_path):
    rc, lines = _run_gpu_tests(tmp_path, GPU_TEST_FILES="test_triton_launch.py\n  test_compile.py",
                                GPU_TEST_DEADLINE="0")  # names on two lines
    rows = [line.split()[:2] for line in lines if line.startswith("test_")]
    assert rows == [["test_triton_launch.py", "not-reached"], ["test_compile.py", "not-reached"]]
    assert rc == 1


def test_run_gpu_tests_records_the_commit_it_is_given(tmp_path):
    _, lines = _run_gpu_tests(tmp_path, GPU_TEST_FILES="test_compile.py", GPU_TEST_DEADLINE="0",
                              GPU_TEST_COMMIT="abc1234")
    assert "commit abc1234" in lines, lines


def test_run_gpu_tests_reports_a_failing_file(tmp_path):
    # A file pytest cannot collect (not a test file of the tree): pytest's usage error is a failure, not "ok".
    rc, lines = _run_gpu_tests(tmp_path, GPU_TEST_FILES="no_such_test_file.py")
    rows = [line.split()[:2] for line in lines if line.startswith("no_such")]
    assert rows and rows[0][1].startswith("failed("), rows
    assert rc == 1
