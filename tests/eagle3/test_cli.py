from __future__ import annotations

import pytest

from eagle3.cli import main


@pytest.mark.parametrize("command", [["promoted"], ["lineage", "run-1"], ["artifacts", "gc"], ["artifacts", "gc", "--dry-run"]])
def test_commands_that_read_a_store_refuse_a_missing_one_instead_of_creating_it(command, tmp_path, capsys):
    typo = tmp_path / "stroe"

    assert main([*command, "--store", str(typo)]) == 2

    assert f"{typo}: no artifact store here" in capsys.readouterr().err
    assert not typo.exists()


def test_the_commands_a_run_prints_name_eagle3_as_the_shell_would_find_it(tmp_path, monkeypatch):
    """The README runs `.venv/bin/eagle3`, with no virtual environment active: a printed `eagle3 lineage ...`
    would not be found. Printed as started, unless the shell finds this very file by its name."""
    from eagle3.cli import _this_command

    script = tmp_path / "venv" / "bin" / "eagle3"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["venv/bin/eagle3", "run"])
    monkeypatch.setenv("PATH", "/usr/bin:/bin")

    assert _this_command() == "venv/bin/eagle3"

    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin:/bin")  # an active environment
    assert _this_command() == "eagle3"

    monkeypatch.setattr("sys.argv", ["/usr/lib/python3/site-packages/eagle3/cli.py", "run"])  # python -m eagle3.cli
    assert _this_command() == "eagle3"
