"""`kvchat` checks flags, settings and the model before the UI starts: one line, status 2."""
from __future__ import annotations

import pytest
import torch

from kvchat.cli.command import main
from kvchat.store.settings import config_path


def run(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


@pytest.mark.parametrize("argv, problem", [
    (["--theme", "pink"], "unknown --theme 'pink'; accepted: dark, light, high-contrast"),
    (["--model", "/no/such/model"], "model '/no/such/model' not found"),
    (["--policy", "forever"], "unknown cap policy 'forever'"),
    (["--resume"], "--resume: no saved conversation yet"),
    (["--kv-budget", "lots"], "cannot read size 'lots'"),
    (["--top-p", "0"], "top-p must be in (0, 1]"),
])
def test_bad_input_ends_before_the_ui_with_one_line_and_status_2(capsys, argv, problem):
    code, err = run(capsys, *argv)
    assert code == 2 and problem in err and err.count("\n") == 1 and err.startswith("kvchat: ")


def test_a_broken_settings_file_ends_before_the_ui(capsys):
    config_path().parent.mkdir(parents=True)
    config_path().write_text("{oops")
    code, err = run(capsys)
    assert code == 2 and "not valid JSON" in err and err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_asking_for_cuda_without_it_ends_before_the_ui(capsys):
    code, err = run(capsys, "--device", "cuda")
    assert code == 2 and "no CUDA device" in err
