from jaxremat.cli import main


def test_demo_prints_every_algorithm_and_a_schedule(capsys):
    assert main(["demo", "--budgets", "40%", "80%"]) == 0
    out = capsys.readouterr().out
    for name in ("optimal", "revolve", "sqrt", "every_stage", "store_all", "recompute_all"):
        assert name in out
    assert "optimal schedule at 80%" in out and "stored whole (Fall)" in out


def test_demo_bad_budget_is_a_one_line_error(capsys):
    assert main(["demo", "--budgets", "lots"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("jaxremat: error: cannot read a byte size from 'lots'")
