"""The CLI's flags on the session cluster: the job's device and precision reach the run (one short run);
every strategy setting is a flag: tests/unit/test_cli_flags.py."""
import pytest

from workbench.cli import main as cli


def test_device_and_precision_are_flags_that_reach_the_job(client, tmp_path, capsys):
    import json

    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["train", "--precision", "fp16"])
    assert "argument --precision: invalid choice: 'fp16'" in capsys.readouterr().err
    code = cli.main(["train", "--dataset", "digits", "--workers", "2", "--scheduler", client.scheduler.address,
                     "--no-progress", "--run-dir", str(tmp_path), "--steps", "20", "--device", "cpu",
                     "--precision", "bf16"])
    assert code == 0, capsys.readouterr()
    config = json.loads(next(tmp_path.glob("*/config.json")).read_text())
    assert config["job"]["precision"] == "bf16" and config["job"]["device"] == "cpu"
    assert [d["device"] for d in config["devices"]] == ["cpu", "cpu"]
