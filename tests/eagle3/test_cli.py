from __future__ import annotations

import pytest

from eagle3.cli import main


@pytest.mark.parametrize("command", [["promoted"], ["lineage", "run-1"], ["artifacts", "gc"], ["artifacts", "gc", "--dry-run"]])
def test_commands_that_read_a_store_refuse_a_missing_one_instead_of_creating_it(command, tmp_path, capsys):
    typo = tmp_path / "stroe"

    assert main([*command, "--store", str(typo)]) == 2

    assert f"{typo}: no artifact store here" in capsys.readouterr().err
    assert not typo.exists()
