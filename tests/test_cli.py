"""The command line: demo, plan and bench on small models; user mistakes as one-line errors."""

import json

import pytest

import jaxremat as jr
from jaxremat.tools.cli import main

SMALL = ["--model", "tests.cli_models:mixer", "--input-shape", "2,8,8,3", "--method", "xla", "--quiet"]


def test_demo_trains_under_the_plan_and_compares_with_manual_strategies(capsys):
    assert main(["demo", *SMALL, "--steps", "2", "--budget", "60%"]) == 0
    out = capsys.readouterr().out
    assert "stored whole (Fall)" in out or "checkpointed (Fck)" in out
    assert "the plain model's losses differ by at most 0\n" in out  # exact gradients: identical losses
    for name in ("no remat", "remat every block", "policy dots_saveable", "jaxremat optimal", "XLA-measured"):
        assert name in out


def test_plan_prints_schedule_saves_plan_and_plots(tmp_path, capsys):
    png, saved = tmp_path / "front.png", tmp_path / "plan.json"
    args = ["plan", "--model", "gpt", "--input-shape", "2,16", "--method", "xla", "--quiet", "--budget", "50%"]
    assert main([*args, "--plot", str(png), "--save", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "schedule (optimal)" in out and "revolve" in out and "predicted peak" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    plan = jr.load_plan(saved)
    assert plan.schedule.peak <= plan.schedule.budget
    assert json.loads(saved.read_text())["algorithm"] == "optimal"


def test_bench_writes_csv_markdown_and_plot(tmp_path, capsys):
    args = [
        "bench",
        "--model",
        "tests.cli_models:resnet",
        "--input-shape",
        "2,8,8,3",
        "--method",
        "xla",
        "--quiet",
        "--rounds",
        "1",
    ]
    assert main([*args, "--points", "2", "--manual", "policy dots_saveable", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| policy dots_saveable |" in out and "jaxremat optimal" in out and "remat every block" not in out
    csv = (tmp_path / "tests_cli_models_resnet.csv").read_text()
    assert "policy dots_saveable" in csv and ",matched," in csv and ",calibrated," in csv
    assert (tmp_path / "tests_cli_models_resnet.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--model", "nosuchmodel", "--budget", "40%"], "cannot find model 'nosuchmodel'"),
        (["plan", "--model", "nosuch.module:f", "--budget", "40%"], "cannot import 'nosuch.module'"),
        (["plan", "--model", "jaxremat.tools.models:nothing", "--budget", "40%"], "has no attribute 'nothing'"),
        (
            ["plan", "--model", "jaxremat.tools.models:sample_input", "--budget", "1", "--input-shape", "2"],
            "must be a model",
        ),
        (["plan", "--model", "jaxremat.tools.models:resnet", "--budget", "40%"], "--input-shape is needed"),
        (["plan", "--model", "resnet", "--input-shape", "2,a,3", "--budget", "40%"], "cannot read an input shape"),
        (
            ["plan", "--model", "gpt", "--input-shape", "2,16", "--dtype", "float32", "--budget", "40%"],
            "cannot take an input of shape",
        ),
        (["plan", *SMALL, "--budget", "lots"], "cannot read a byte size from 'lots'"),
        (["plan", *SMALL, "--budget", "1KiB"], "needs on this chain: at least"),
        (["demo", "--dtype", "floaty"], "unknown --dtype 'floaty'"),
        (["bench", *SMALL, "--manual", "remat everything"], "unknown manual strategies ['remat everything']"),
    ],
)
def test_user_mistakes_are_one_line_errors(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxremat: error: ") and message in err, err
    assert err.count("\n") == 1


def test_plan_takes_a_model_that_is_not_a_sequential(tmp_path, monkeypatch, capsys):
    (tmp_path / "skipnet.py").write_text(
        "import flax.linen as nn\n"
        "class Net(nn.Module):\n"
        "    @nn.compact\n"
        "    def __call__(self, x):\n"
        "        skip = x\n"
        "        for _ in range(4):\n"
        "            x = nn.gelu(nn.Dense(64)(x))\n"
        "        return nn.Dense(8)(x + nn.Dense(64)(skip))\n"
    )
    monkeypatch.chdir(tmp_path)
    args = ["plan", "--model", "skipnet:Net", "--input-shape", "32,64", "--method", "xla", "--quiet", "--budget", "50%"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "7 stages cut by Flax module scope" in out and "schedule (optimal)" in out
    assert "0:Net/Dense_0" in out
